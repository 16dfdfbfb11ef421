"""The library every front end shares (the generate CLI, the bench and tools, the demo, the Python API and a
server): open a model, build a request's prompt, turn a request into decode settings, run it.

    loaded = load_model(Path("artifacts/dialogsum"))
    request = DecodeRequest(max_new_tokens=64)
    result = run(loaded, prompt_ids(loaded, "#Person1#: Hi ...", as_task=True), decode_settings(loaded, request))
    print(text_of(loaded, result))

A front end states what it was asked as a DecodeRequest (the CLI from its flags, the demo from its panes, a
server from its JSON); `decode_settings` is the one place a request becomes DecodeSettings, with the tree
choice and every check on the way. Bad values are ValueErrors of one line naming the field and the fix;
nothing here parses flags or prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from streamfuse.methods import registry
from streamfuse.runtime.backends.base import PruneConfig, prune_config
from streamfuse.runtime.decode import GenerationResult, StepEvent, generate
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.loader import Loaded, artifact_tasks, fastest_backend, load
from streamfuse.runtime.prompt import check_text
from streamfuse.runtime.sampling import SamplingConfig
from streamfuse.runtime.settings import DecodeSettings
from streamfuse.runtime.trace import Trace
from streamfuse.runtime.tree import TreeSpec

# For checkpoints (artifacts carry their own tree): the chain plus stream 1's second candidate.
# On a CPU with packed kernels it costs what the chain does and is the fastest tree measured
# (1.35x vs 1.23x for the chain, 1.12x for gamma=3,k=2; docs/benchmarks.md).
DEFAULT_TREE = "[[0],[1],[0,0],[0,0,0]]"
DEFAULT_METHOD = registry.default()  # what a request decodes with unless it names a method
BASELINE_METHOD = registry.plain()  # plain decoding: every speed-up's baseline and every parity check's reference


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


def check_task(loaded: Loaded, task: str, name: str = "task") -> None:
    """ValueError unless `loaded` was fine-tuned for `task` and records its prompt format; `name` is what the
    caller's user calls the task setting (a CLI: its flag)."""
    served = loaded.tasks
    if loaded.info.get("task") != task:
        serves = f"serves {', '.join(served)}" if len(served) > 1 else f"was fine-tuned for {loaded.info.get('task')!r}"
        raise ValueError(f"{name} {task}: {_where(loaded)} {serves}; use that task name or drop {name}")
    check_prompt_format(loaded, f"{name} {task}")


def check_prompt_format(loaded: Loaded, name: str = "as_task") -> None:
    """ValueError unless `loaded` records its task's prompt format (what formats a task's source); `name`: the
    setting that asked for it."""
    if loaded.prompt is None:
        raise ValueError(
            f"{name}: {_where(loaded)} records no prompt format; build the artifact again (the "
            f"build adds it without retraining) or pass plain prompts without {name.split()[0]}"
        )


def _where(loaded: Loaded) -> str:
    return str(loaded.artifact.path) if loaded.artifact is not None else "the checkpoint"


# --- prompts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    """One input to decode: its id (in results and traces) and its text."""

    id: str
    text: str  # a task source (as_task) or a plain user message


def prompt_ids(loaded: Loaded, text: str, as_task: bool, cut_source: bool = True) -> list[int]:
    """Token ids of an input: a task source in the task's prompt format (cut to the length training saw unless
    cut_source is False), else a user message in the tokenizer's chat template."""
    tokenizer = loaded.tokenizer
    check_text(text, "the prompt")
    if as_task:
        rendered = loaded.prompt.render(tokenizer, text, cut=cut_source)
    else:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def source_overflow(loaded: Loaded, text: str, as_task: bool) -> int:
    """How many of a task source's tokens its prompt cuts off (as training did); 0 when it fits or is no source."""
    if not as_task:
        return 0
    return loaded.prompt.overflow(loaded.tokenizer, text)


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


# --- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRequest:
    """What one generation asks for, as a front end states it (no model needed to build or check it)."""

    method: str = DEFAULT_METHOD  # a registered method's name
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # stop strings
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    tree: str | None = None  # TreeSpec.parse's text; None: the method's own tree (choose_tree)
    fallback: bool = True  # decode plainly while speculation does not pay (where the tree's step cost is calibrated)
    prune_threshold: float | None = None  # drop tree nodes whose early-exit transition probability is below this
    prune_budget: int | None = None  # keep at most this many non-root tree nodes
    threshold: float | None = None  # a stop-threshold method's: stop drafting once P(a rejection) passes it

    def check(self) -> None:
        """ValueError naming the first bad field: what a front end refuses before the (slow) model load."""
        registry.get(self.method)
        self.rules()
        self.sampling()
        self.prune()
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a probability in [0, 1], got {self.threshold}")
        if self.tree is not None:
            TreeSpec.parse(self.tree)
        for stop in self.stop:
            check_text(stop, "a stop string")

    def rules(self, stop_token_ids: tuple[int, ...] = ()) -> StopRules:
        return StopRules(self.max_new_tokens, stop_token_ids, tuple(self.stop))

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def prune(self) -> PruneConfig | None:
        return prune_config(self.prune_threshold, self.prune_budget)


def check_method(loaded: Loaded, name: str) -> None:
    """ValueError unless `name` is registered and `loaded` carries its drafters."""
    method = registry.get(name)
    if name not in loaded.methods:
        raise ValueError(
            f"method {name!r} is not available for this model; it decodes with "
            f"{', '.join(loaded.methods)}: {_where(loaded)} has no drafter for it (build the artifact "
            f"with {method.build_flags} to add it)"
        )


def choose_tree(text: str | None, loaded: Loaded, method: str = DEFAULT_METHOD) -> TreeSpec:
    """`text` parsed (within the largest tree the backend runs), else the method's own tree (the default method:
    the backend's calibrated tree or the artifact's default; a draft model's: its chain; ...), else DEFAULT_TREE."""
    if text is not None:
        return TreeSpec.parse(text, loaded.max_nodes, "the artifact's largest step graph")
    tree = loaded.method_tree(method)
    return tree if tree is not None else TreeSpec.parse(DEFAULT_TREE)


def decode_settings(loaded: Loaded, request: DecodeRequest) -> DecodeSettings:
    """The request as the decode loop takes it on `loaded`: its method's tree, checked against the backend's
    graphs, and the fallback where the method drafts from streams (their calibrated step costs are its)."""
    request.check()
    check_method(loaded, request.method)
    method = registry.get(request.method)
    tree = choose_tree(request.tree, loaded, request.method)
    if method.speculative:
        loaded.check_method_tree(request.method, tree)
    fallback = loaded.fallback(tree) if request.fallback and method.streams else None
    return DecodeSettings(
        request.method,
        request.rules(loaded.stop_token_ids),
        tree,
        request.sampling(),
        request.prune(),
        request.seed,
        fallback,
        request.threshold,
    )


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
        decode=loaded.tokenizer.decode,
    )


def text_of(loaded: Loaded, result: GenerationResult) -> str:
    """A result's new tokens as text, special tokens left out."""
    return loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
