"""The library every front end shares (the generate CLI, the bench and tools, the demo, the Python API and a
server): open a model, build a request's prompt, turn a request into decode settings, run it.

    loaded = load_model(Path("artifacts/dialogsum"))
    request = DecodeRequest(max_new_tokens=64)
    result = run(loaded, prompt_ids(loaded, "#Person1#: Hi ...", as_task=True), decode_settings(loaded, request))
    print(text_of(loaded, result))

A front end states what it was asked as a DecodeRequest (the CLI from its flags, the demo from its panes, a
server from its JSON); runtime/request/checks.py's `decode_settings` is the one place a request becomes DecodeSettings,
and the one home of every check on the way (re-exported here). Bad values are ValueErrors of one line naming the
field and the fix; nothing here parses flags or prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from streamfuse.runtime.artifact.prompt import check_text
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.checks import BASELINE_METHOD as BASELINE_METHOD
from streamfuse.runtime.request.checks import DEFAULT_METHOD as DEFAULT_METHOD
from streamfuse.runtime.request.checks import DEFAULT_TREE as DEFAULT_TREE
from streamfuse.runtime.request.checks import DecodeRequest as DecodeRequest
from streamfuse.runtime.request.checks import check_method as check_method
from streamfuse.runtime.request.checks import check_prompt_format as check_prompt_format
from streamfuse.runtime.request.checks import check_task as check_task
from streamfuse.runtime.request.checks import choose_tree as choose_tree
from streamfuse.runtime.request.checks import decode_settings as decode_settings
from streamfuse.runtime.request.decode import GenerationResult, StepEvent, generate
from streamfuse.runtime.request.loader import Loaded, artifact_tasks, fastest_backend, load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace

# --- the model ----------------------------------------------------------------------------------


def load_model(
    artifact: Path,
    backend: str | None = None,
    device: str = "cpu",
    stream_schedule: str = "fused",
    threads: int | None = None,
    task: str | None = None,
) -> Loaded:
    """An artifact or checkpoint folder, loaded on `backend` (None: the fastest it has here, by its calibrations);
    on an artifact serving several tasks, `task` picks one (a task it does not serve loads its own)."""
    task = task if task in artifact_tasks(artifact) else None
    backend = backend or fastest_backend(artifact, task)
    return load(artifact, backend, device, stream_schedule, threads, task=task)


# --- prompts ------------------------------------------------------------------------------------


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


# --- runs ---------------------------------------------------------------------------------------


def new_trace(
    loaded: Loaded, settings: DecodeSettings, enabled: bool = True, device: str = "cpu", threads: int | None = None
) -> Trace:
    """A trace of runs with these settings, its header naming the backend, method and tree."""
    tree = settings.tree.to_dict() if registry.get(settings.method).speculative else None
    return Trace(
        enabled=enabled,
        backend=loaded.backend.name,
        device=device,
        method=settings.method,
        num_streams=loaded.backend.num_streams,
        tree=tree,
        threads=threads,
    )


def run(
    loaded: Loaded,
    ids: list[int],
    settings: DecodeSettings,
    trace: Trace | None = None,
    run_id: str = "0",
    on_step: Callable[[StepEvent], None] | None = None,
) -> GenerationResult:
    """Decode from prompt `ids` with the method's drafter; `on_step` sees every step (raise in it to stop)."""
    return generate(
        loaded.backend,
        ids,
        settings,
        drafter=loaded.drafter(settings),
        trace=trace,
        run_id=run_id,
        on_step=on_step,
        detokenizer=loaded.tokenizer.decode,
    )


def text_of(loaded: Loaded, result: GenerationResult) -> str:
    """A result's new tokens as text, special tokens left out."""
    return loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
