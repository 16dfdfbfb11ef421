"""Where a request becomes decode settings, and the one home of each check on the way.

    request = DecodeRequest(max_new_tokens=64)          # what a front end was asked (flags, JSON, arguments)
    settings = decode_settings(loaded, request)           # fields, method, tree, fallback: checked once
    capacity = check_fits(loaded.backend, ids, settings.rules, tree)   # the prompt's ids, and its fit

Every entry (the generate CLI, runtime/request/api.py's Model, the server's request parser, the demo) calls these
functions, each check once on its path; the decode loop (decode.Generation.begin) calls the same prompt checks
only when its caller did not (no capacity given). A check's message lives here, in one place, one line.

| check                | its home               |
| prompt ids           | check_prompt_ids       |
| prompt text          | prompt.check_text      |
| request fields       | DecodeRequest.check    |
| method available     | check_method           |
| task                 | check_task             |
| fits in the context  | check_fits             |
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamfuse.runtime.artifact.prompt import check_text
from streamfuse.runtime.backends.base import Backend, PruneConfig, prune_config
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

if TYPE_CHECKING:
    from streamfuse.runtime.request.loader import Loaded

# For checkpoints (artifacts carry their own tree): the chain plus stream 1's second candidate.
# On a CPU with packed kernels it costs what the chain does and is the fastest tree measured
# (1.35x vs 1.23x for the chain, 1.12x for gamma=3,k=2; docs/benchmarks.md).
DEFAULT_TREE = "[[0],[1],[0,0],[0,0,0]]"
DEFAULT_METHOD = registry.default()  # what a request decodes with unless it names a method
BASELINE_METHOD = registry.plain()  # plain decoding: every speed-up's baseline and every parity check's reference


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

    def check(self, stop_name: str = "a stop string") -> None:
        """ValueError naming the first bad field: what a front end refuses before the (slow) model load; stop_name:
        what its user calls a stop string (a CLI: its flag)."""
        registry.get(self.method)
        self.rules()
        self.sampling()
        self.prune()
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a probability in [0, 1], got {self.threshold}")
        if self.tree is not None:
            TreeSpec.parse(self.tree)
        for stop in self.stop:
            check_text(stop, stop_name)

    def rules(self, stop_token_ids: tuple[int, ...] = ()) -> StopRules:
        return StopRules(self.max_new_tokens, stop_token_ids, tuple(self.stop))

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    def prune(self) -> PruneConfig | None:
        return prune_config(self.prune_threshold, self.prune_budget)


# --- the model's side: method, task, tree ----------------------------------------------------------


def where(loaded: Loaded) -> str:
    return str(loaded.artifact.path) if loaded.artifact is not None else "the checkpoint"


def check_method(loaded: Loaded, name: str) -> None:
    """ValueError unless `name` is registered and `loaded` carries its drafters."""
    method = registry.get(name)
    if name not in loaded.methods:
        raise ValueError(
            f"method {name!r} is not available for this model; it decodes with "
            f"{', '.join(loaded.methods)}: {where(loaded)} has no drafter for it (build the artifact "
            f"with {method.build_flags} to add it)"
        )


def check_task(loaded: Loaded, task: str, name: str = "task") -> None:
    """ValueError unless `loaded` was fine-tuned for `task` and records its prompt format; `name` is what the
    caller's user calls the task setting (a CLI: its flag)."""
    served = loaded.tasks
    if loaded.info.get("task") != task:
        serves = f"serves {', '.join(served)}" if len(served) > 1 else f"was fine-tuned for {loaded.info.get('task')!r}"
        raise ValueError(f"{name} {task}: {where(loaded)} {serves}; use that task name or drop {name}")
    check_prompt_format(loaded, f"{name} {task}")


def check_prompt_format(loaded: Loaded, name: str = "as_task") -> None:
    """ValueError unless `loaded` records its task's prompt format (what formats a task's source); `name`: the
    setting that asked for it."""
    if loaded.prompt is None:
        raise ValueError(
            f"{name}: {where(loaded)} records no prompt format; build the artifact again (the "
            f"build adds it without retraining) or pass plain prompts without {name.split()[0]}"
        )


def choose_tree(text: str | None, loaded: Loaded, method: str = DEFAULT_METHOD) -> TreeSpec:
    """`text` parsed (within the largest tree the backend runs), else the method's own tree (the default method:
    the backend's calibrated tree or the artifact's default; a draft model's: its chain; ...), else DEFAULT_TREE."""
    if text is not None:
        return TreeSpec.parse(text, loaded.max_nodes, "the artifact's largest step graph")
    tree = loaded.method_tree(method)
    return tree if tree is not None else TreeSpec.parse(DEFAULT_TREE)


def decode_settings(loaded: Loaded, request: DecodeRequest, checked: bool = False) -> DecodeSettings:
    """The request as the decode loop takes it on `loaded`: its method's tree, checked against the backend's
    graphs, and the fallback where the method drafts from streams (their calibrated step costs are its).
    checked: the caller ran request.check() already (a CLI does, before its model load)."""
    if not checked:
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


# --- the prompt -----------------------------------------------------------------------------------


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Prompt token ids as ints: at least one, each an integer within the vocabulary."""
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise ValueError("a prompt is a str or a sequence of int token ids")
    if len(ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [int(t) for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def check_fits(backend: Backend, ids: Sequence[int], rules: StopRules, tree: TreeSpec | None) -> int:
    """The prompt checked (check_prompt_ids), then the KV positions a run can touch: prompt, every emitted token,
    and one step's scratch rows of `tree` (None: a plain step; a static graph's size bucket). Checked before any
    work, so a run never stops half-way for lack of context: the capacity Generation.begin takes."""
    check_prompt_ids(ids, backend.vocab_size)
    step_rows = backend.step_rows(tree)
    needed = len(ids) + rules.max_new_tokens + step_rows
    if needed > backend.max_positions:
        raise ValueError(
            f"prompt of {len(ids)} tokens + max_new_tokens {rules.max_new_tokens} + a step's "
            f"{step_rows} rows exceeds the model's context of {backend.max_positions} positions; shorten the "
            f"prompt, lower max_new_tokens, or (an exported artifact) rebuild it with a larger "
            f"--set export.capacity=N"
        )
    return needed


def step_tree(settings: DecodeSettings) -> TreeSpec | None:
    """The tree whose step rows bound a run's (None: plain steps, one row); a method's drafter steps in it or in
    smaller trees (ss-adaptive: calibrated candidates of at most its nodes)."""
    return settings.tree if registry.get(settings.method).speculative else None
