"""Benchmark inputs: a task split's rows -> (id, source text, references).

tools/ may not import export/ (one-way data flow), so the task files are a small table here:
the same file names training/tasks/*.py read, looked up in --data-dir (or its <task>/ folder),
$STREAMFUSE_DATA_DIR/<task>, then ../shared/data/<task> beside the checkout. --input-file
overrides the table. JSON lines rows are the task's fields ("summary1".."summary3" for the
DialogSum test split); CSV rows (E2E NLG) are one (mr, ref) pair per line, grouped per MR.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

from streamfuse.runtime.artifact.prompt import PromptFormat

SHARED_DATA_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SPLIT_ALIASES = {"dev": "validation", "val": "validation"}
# (task, split) -> file name inside the task's data folder
TASK_FILES = {
    ("dialogsum", "train"): "dialogsum.train.jsonl",
    ("dialogsum", "validation"): "dialogsum.dev.jsonl",
    ("dialogsum", "test"): "dialogsum.test.jsonl",
    ("e2e_nlg", "test"): "testset_w_refs.csv",
}
# reference fields, in order; the first present non-empty ones are kept
REFERENCE_FIELDS = ("summary1", "summary2", "summary3", "summary", "ref", "answer", "target")


@dataclass(frozen=True)
class BenchInput:
    id: str
    text: str  # the task source, formatted by the model's PromptFormat later
    references: tuple[str, ...]


def task_file(task: str, split: str, data_dir: Path | None = None) -> Path:
    """The local file of a task split; FileNotFoundError says where it looked."""
    split = SPLIT_ALIASES.get(split, split)
    name = TASK_FILES.get((task, split))
    if name is None:
        known = ", ".join(f"{t}/{s}" for t, s in TASK_FILES)
        raise FileNotFoundError(f"no known file for task {task!r} split {split!r} (known: {known}); pass --input-file")
    if data_dir is not None:
        folders = [Path(data_dir), Path(data_dir) / task]
    else:
        env = os.environ.get("STREAMFUSE_DATA_DIR", "").strip()
        folders = ([Path(env) / task] if env else []) + [SHARED_DATA_ROOT / task]
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{name} not found in {', '.join(map(str, folders))}; pass --data-dir or --input-file")


def _references(row: dict) -> tuple[str, ...]:
    refs = row.get("references")
    if isinstance(refs, list):
        return tuple(str(r) for r in refs if str(r).strip())
    return tuple(row[k] for k in REFERENCE_FIELDS if isinstance(row.get(k), str) and row[k].strip())


def _jsonl_rows(path: Path):
    """(id, row) per JSON line; ids as runtime.request.inputs.read_input_file gives them."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
                yield str(row.get("id", row.get("fname", number))), row, f"{path}:{number}"


def _csv_rows(path: Path):
    """One row per distinct MR with all its references, named after its first data row (as export does)."""
    groups: dict[str, tuple[int, list[str]]] = {}
    with path.open(encoding="utf-8", newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            if "mr" not in row or "ref" not in row:
                raise ValueError(f"{path}: CSV inputs need columns mr, ref (got {', '.join(row)})")
            groups.setdefault(row["mr"], (index, []))[1].append(row["ref"])
    for mr, (first, refs) in groups.items():
        yield f"e2e-test-{first}", {"mr": mr, "references": refs}, f"{path} row {first}"


def read_inputs(path: Path, prompt: PromptFormat, limit: int | None) -> list[BenchInput]:
    """The first `limit` inputs of a JSON lines or CSV file."""
    path = Path(path)
    rows = _csv_rows(path) if path.suffix == ".csv" else _jsonl_rows(path)
    inputs = []
    for row_id, row, where in rows:
        if limit is not None and len(inputs) >= limit:
            break
        inputs.append(BenchInput(row_id, prompt.fill_source(row, where), _references(row)))
    if not inputs:
        raise ValueError(f"{path} holds no inputs")
    return inputs
