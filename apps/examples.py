"""DialogSum test dialogues to pick from, with their reference summaries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The task data lives beside the checkout (as for streamfuse build): <repo>/../shared/data/<task>.
DEFAULT_EXAMPLES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "dialogsum" / "dialogsum.test.jsonl"


@dataclass(frozen=True)
class Example:
    id: str
    dialogue: str
    references: tuple[str, ...]  # summary1, summary2, ... (test rows have three)

    @property
    def title(self) -> str:
        first_line = self.dialogue.splitlines()[0] if self.dialogue else ""
        return f"{self.id}: {first_line[:60]}"


def read_examples(path: Path, limit: int = 100) -> list[Example]:
    """The first `limit` rows of a DialogSum JSON-lines file ("fname", "dialogue", "summary<N>")."""
    examples = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if len(examples) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("dialogue"), str):
                raise ValueError(f"{path}:{number}: no 'dialogue' field; expected DialogSum rows")
            references = tuple(
                row[key] for key in sorted(row) if key.startswith("summary") and isinstance(row[key], str)
            )
            examples.append(Example(str(row.get("fname", number)), row["dialogue"], references))
    return examples
