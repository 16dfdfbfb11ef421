"""The backend protocol: what the decode loop needs from any execution engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from streamfuse.runtime.tree import TreeSpec

# When streams run: "fused" in the verify pass at every tree node (the paper; memory-bound devices),
# "deferred" after the commit for the last accepted node only (same outputs; compute-bound CPUs).
STREAM_SCHEDULES = ("fused", "deferred")


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
    """Peak resident memory of this process (Linux reports KiB): the CPU backends' peak memory."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prune_config(threshold: float | None, budget: int | None) -> PruneConfig | None:
    """CLI flags -> PruneConfig, or None when neither is given (no pruning)."""
    return None if threshold is None and budget is None else PruneConfig(threshold, budget)


@dataclass
class StepOutput:
    main_logits: torch.Tensor  # [T, V] target logits after each input token (prefill: last token only)
    stream_logits: Callable[[int], torch.Tensor] | None  # node -> [gamma, V] stream logits at that node
    kept: Sequence[bool] | None = None  # per node: survived pruning (None: no pruning)


class Backend(Protocol):
    name: str
    device: str
    num_streams: int
    vocab_size: int
    max_positions: int  # the model's context length

    def reset(self, capacity: int) -> None:
        """Empty the KV cache and make room for `capacity` positions."""

    def prefill(self, token_ids: Sequence[int], with_streams: bool) -> StepOutput:
        """Run the prompt; streams (if on) at its last token."""

    def step(self, tokens: Sequence[int], tree: TreeSpec | None, with_streams: bool,
             prune: PruneConfig | None = None) -> StepOutput:
        """One forward over a flattened tree draft (tree None: a single token)."""

    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the K/V of these nodes of the last step (ascending indices)."""

    def peak_memory_bytes(self) -> int | None:
        """Peak memory of the device, or None where it cannot be read."""
