"""sql-create-context: text-to-SQL given the CREATE TABLE statements of the schema.

The data set has a single split, so validation and test are carved from its
end: the last HOLDOUT rows are test, the HOLDOUT before them validation, the
rest train. Position-based carving keeps ids ("sql-<row>") and splits stable
for a given file; files with fewer than 10 * HOLDOUT rows (e.g. small
samples) hold out a tenth each instead, so train is never empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from streamfuse.metrics.sql import exact_match

from .base import DataError, Example, Task
from .records import Row, read_json_array, read_jsonl

HOLDOUT = 1000
# .jsonl is the documented layout; the .json names are the hub's original
# array file (with and without its version suffix), accepted as downloaded.
LOCAL_FILES = ("sql_create_context.jsonl", "sql_create_context.json", "sql_create_context_v4.json")


def split_bounds(n_rows: int) -> dict[str, range]:
    """Row ranges of each split for a file of *n_rows* rows."""
    holdout = min(HOLDOUT, n_rows // 10)
    return {
        "train": range(0, n_rows - 2 * holdout),
        "validation": range(n_rows - 2 * holdout, n_rows - holdout),
        "test": range(n_rows - holdout, n_rows),
    }


class SQLContext(Task):
    name = "sqlcontext"
    hub_id = "b-mc2/sql-create-context"
    headline_metrics = ("exact_match",)
    instruction_template = (
        "Write the SQL query that answers the question, using only the tables in the schema. "
        "Reply with the query only.\n\n{source}"
    )
    source_template = "Schema: {context}\nQuestion: {question}"
    data_help = (
        f"  {LOCAL_FILES[0]}: one JSON object per line with fields question, context "
        "(the CREATE TABLE statements), answer (the SQL query)\n"
        f"  or {LOCAL_FILES[1]}: a JSON array of such objects (the hub's file layout)"
    )

    def local_files(self, split: str) -> tuple[str, ...]:
        return LOCAL_FILES

    def read_local(self, split: str, path: Path) -> list[Example]:
        rows = read_jsonl(path) if path.suffix == ".jsonl" else read_json_array(path)
        return self._carve(split, rows, str(path))

    def read_hub(self, split: str) -> list[Example]:
        raw = self.hub_rows("train")  # the hub's only split
        rows = [Row(f"{self.hub_id} [train] row {i}", r) for i, r in enumerate(raw)]
        return self._carve(split, rows, self.hub_id)

    @staticmethod
    def _carve(split: str, rows: Sequence[Row], origin: str) -> list[Example]:
        if not rows:
            raise DataError(f"{origin}: no rows")
        # Validate every row, not just this split's, so a bad file fails the
        # same way whichever split is loaded first.
        examples = [
            Example(
                id=f"sql-{i}",
                source=f"Schema: {row.text('context')}\nQuestion: {row.text('question')}",
                references=(row.text("answer"),),
            )
            for i, row in enumerate(rows)
        ]
        return [examples[i] for i in split_bounds(len(examples))[split]]

    def score(self, predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
        return exact_match(predictions, references)
