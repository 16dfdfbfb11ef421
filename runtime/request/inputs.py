"""A request's inputs: a prompt's token ids (a task source in the task's prompt format, or a user message in the
chat template) and JSON-lines input files, each bad row a one-line ValueError naming its line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from streamfuse.runtime.artifact.prompt import check_text
from streamfuse.runtime.request.loader import Loaded


@dataclass(frozen=True)
class Input:
    """One input to decode: its id (in results and traces) and its text."""

    id: str
    text: str  # a task source (as_task) or a plain user message


def prompt_ids(loaded: Loaded, text: str, as_task: bool, cut_source: bool = True, checked: bool = False) -> list[int]:
    """Token ids of an input: a task source in the task's prompt format (cut to the length training saw unless
    cut_source is False), else a user message in the tokenizer's chat template. checked: the caller ran check_text
    on `text` already, naming it as its user knows it (a CLI flag, an input file's line, a JSON field)."""
    tokenizer = loaded.tokenizer
    if not checked:
        check_text(text, "the prompt")
    if as_task:
        rendered = loaded.prompt.render(tokenizer, text, cut=cut_source, checked=True)
    else:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def source_overflow(loaded: Loaded, text: str, as_task: bool, checked: bool = False) -> int:
    """How many of a task source's tokens its prompt cuts off (as training did); 0 when it fits or is no source.
    checked: as prompt_ids'."""
    if not as_task:
        return 0
    return loaded.prompt.overflow(loaded.tokenizer, text, checked)


def read_input_file(path: Path, loaded: Loaded, as_task: bool, limit: int | None = None) -> Iterator[Input]:
    """JSON lines: as_task, each row gives the task's source fields (e.g. "dialogue") or "source"; otherwise
    each row needs "prompt". Ids come from "id", "fname" or the line number. A file with no input is an
    error, not an empty run."""
    count = 0
    with Path(path).open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if limit is not None and count >= limit:
                return
            where = f"{path}:{number}"
            row = _json_row(raw, where)
            if row is not None:
                count += 1
                yield Input(str(row.get("id", row.get("fname", number))), _row_text(row, loaded, as_task, where))
    if count == 0:
        raise ValueError(f"{path}: no inputs (one JSON object per line)")


def _row_text(row: dict, loaded: Loaded, as_task: bool, where: str) -> str:
    if as_task:
        return loaded.prompt.fill_source(row, where)
    if isinstance(row.get("prompt"), str):
        return check_text(row["prompt"], f"{where}: the prompt")
    raise ValueError(f"{where}: needs a 'prompt' field (or read the rows as the task's sources: --task)")


def _json_row(raw: bytes, where: str) -> dict | None:
    """One line's JSON object; None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{where}: not UTF-8 text ({error.reason} at byte {error.start}): save the file as UTF-8"
        ) from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a line must be one JSON object, got {type(row).__name__}")
    return row
