"""DialogSum: abstractive summarisation of everyday two-party dialogues."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from streamfuse.metrics.rouge import rouge

from .base import Example, Task
from .records import Row, read_jsonl

_FILES = {
    "train": "dialogsum.train.jsonl",
    "validation": "dialogsum.dev.jsonl",
    "test": "dialogsum.test.jsonl",
    "unlabelled": "dialogsum.train-unlabelled.jsonl",  # dialogues only (fname, dialogue)
}
TEST_REFERENCES = 3
# The hub stores each test dialogue three times ("test_0_1".."test_0_3"), one
# row per reference summary; the trailing index is dropped to get the dialogue id.
_HUB_TEST_ID = re.compile(r"^(test_\d+)_\d+$")


class DialogSum(Task):
    name = "dialogsum"
    hub_id = "knkarthick/dialogsum"
    headline_metrics = ("rouge1", "rougeLsum")
    has_unlabelled = True
    instruction_template = "Summarize the following dialogue in a few sentences.\n\n{source}"
    source_template = "{dialogue}"
    data_help = (
        "  dialogsum.train.jsonl, dialogsum.dev.jsonl: one JSON object per line with fields "
        "fname, dialogue, summary\n"
        "  dialogsum.test.jsonl: fields fname, dialogue, summary1, summary2, summary3\n"
        "  dialogsum.train-unlabelled.jsonl (self-distillation only): fields fname, dialogue"
    )

    def local_files(self, split: str) -> tuple[str, ...]:
        return (_FILES[split],)

    def read_local(self, split: str, path: Path) -> list[Example]:
        return [self._from_row(split, row) for row in read_jsonl(path)]

    @staticmethod
    def _from_row(split: str, row: Row) -> Example:
        if split == "test":
            refs = tuple(row.text(f"summary{k}") for k in range(1, TEST_REFERENCES + 1))
        elif split == "unlabelled":
            refs = ()
        else:
            refs = (row.text("summary"),)
        return Example(id=row.text("fname"), source=row.text("dialogue"), references=refs)

    def read_hub(self, split: str) -> list[Example]:
        rows = [Row(f"{self.hub_id} [{split}] row {i}", r) for i, r in enumerate(self.hub_rows(split))]
        examples = [Example(row.text("id"), row.text("dialogue"), (row.text("summary"),)) for row in rows]
        return _merge_references(examples) if split == "test" else examples

    def score(self, predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
        return rouge(predictions, references)


def _merge_references(examples: list[Example]) -> list[Example]:
    """One example per dialogue with all its summaries, in first-seen order."""
    merged: dict[str, Example] = {}
    for example in examples:
        first = merged.get(example.source)
        if first is None:
            match = _HUB_TEST_ID.match(example.id)
            merged[example.source] = Example(
                match.group(1) if match else example.id, example.source, example.references
            )
        else:
            merged[example.source] = Example(first.id, first.source, first.references + example.references)
    return list(merged.values())
