"""The backend protocol: what the decode loop needs from any execution engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from streamfuse.runtime.speculation.sampling import ranked
from streamfuse.runtime.speculation.tree import TreeSpec


class CapacityError(RuntimeError):
    """A run needs more KV positions than the backend holds."""


class EngineError(RuntimeError):
    """The engine cannot serve this model as the host needs (it copies the cache it should write in place), or a
    call on a backend whose last call failed, before a reset."""


@dataclass(frozen=True)
class PruneConfig:
    """Tree pruning by the early-exit head (paper 3.2.3): drop nodes whose parent->child
    transition probability is below `threshold`, and/or keep only the `budget` non-root nodes
    with the highest path probability (a fixed budget keeps shapes static)."""

    threshold: float | None = None
    budget: int | None = None

    def __post_init__(self):
        if self.threshold is None and self.budget is None:
            raise ValueError("PruneConfig needs a threshold, a budget, or both")
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"prune budget must be >= 0, got {self.budget}")


def process_peak_rss_bytes() -> int:
    """Peak resident memory of this process: the CPU backends' peak memory.

    Linux: VmHWM, the peak of this process's own address space. Not ru_maxrss, which a spawned
    process inherits from its parent (fork copies the parent's resident pages, and exec keeps
    their count as the peak), so a profile run beside a training process would report its peak."""
    import resource
    import sys

    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, others KiB


def prune_config(threshold: float | None, budget: int | None) -> PruneConfig | None:
    """CLI flags -> PruneConfig, or None when neither is given (no pruning)."""
    return None if threshold is None and budget is None else PruneConfig(threshold, budget)


# StepOutput.extras: what a backend offers beyond the target's tokens and streams, read by the methods
# that need it (a backend leaves out what it cannot give).
HIDDEN = "hidden"  # [T, H] final-normed states (a draft model's, for specdec++'s acceptance head)
STREAM_STATES = "stream_states"  # node -> [gamma, H] its streams' final-normed states (ss-adaptive's head)
HEAD_LOGITS = "head_logits"  # node -> [heads, V] Medusa heads' logits there (the medusa method)


@dataclass
class StepOutput:
    """What one call gives the decode loop: target logits and streams, or (an engine's fused greedy
    step) the target's greedy tokens and the accepted node's ranked draft tokens. numpy arrays on
    the host (float32 logits and states, int64 ids) whatever the engine."""

    main_logits: np.ndarray | None  # [T, V] target logits after each input token (prefill: last token only)
    stream_logits: Callable[[int], np.ndarray] | None  # node -> [gamma, V] stream logits at that node
    kept: Sequence[bool] | None = None  # per node: survived pruning (None: no pruning)
    greedy_tokens: Sequence[int] | None = None  # [T] argmax after each node, chosen by the engine
    ranked_drafts: Callable[[int], np.ndarray] | None = None  # node -> [gamma, K] stream token ids, best first
    extras: dict[str, object] = field(default_factory=dict)  # what some methods' drafters read, by the keys below

    def next_token(self, node: int, choose: Callable[[np.ndarray], int]) -> int:
        """The target's token after `node`: the engine's greedy choice, or `choose` on its logits."""
        if self.greedy_tokens is not None:
            return int(self.greedy_tokens[node])
        return choose(self.main_logits[node])

    def stream_top(self, node: int, width: int) -> np.ndarray:
        """[gamma, width] token ids ranked by each stream at `node` (call after the commit)."""
        if self.ranked_drafts is not None:
            return self.ranked_drafts(node)[:, :width]
        return ranked(self.stream_logits(node), width)


class Backend(Protocol):
    name: str
    device: str
    num_streams: int
    vocab_size: int
    max_positions: int  # the model's context length

    def reset(self, capacity: int) -> None:
        """Empty the KV cache and make room for `capacity` positions."""

    def step_rows(self, tree: TreeSpec | None) -> int:
        """Cache rows a step of `tree` (None: one token) takes before its commit."""

    def prefill(self, token_ids: Sequence[int], with_streams: bool) -> StepOutput:
        """Run the prompt; streams (if on) at its last token."""

    def step(
        self,
        tokens: Sequence[int],
        tree: TreeSpec | None,
        with_streams: bool,
        prune: PruneConfig | None = None,
        greedy: bool = False,
    ) -> StepOutput:
        """One forward over a flattened tree draft (tree None: a single token). greedy: the caller
        decodes greedily, so an engine may return greedy_tokens and ranked_drafts instead of logits."""

    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the K/V of these nodes of the last step (ascending indices)."""

    def rollback(self, length: int) -> None:
        """Forget committed positions from `length` on (a draft model's rejected drafts)."""

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` positions, keeping the committed ones (a generation that keeps a prefix)."""

    def peak_memory_bytes(self) -> int | None:
        """Peak memory of the device, or None where it cannot be read."""
