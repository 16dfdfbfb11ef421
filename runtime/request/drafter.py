"""The method protocol: a drafter proposes what one target call verifies.

    context ─► drafter.propose(root) ─► Draft(tree, tokens, probs) ─► target.step: one call
            ─► accept (runtime/speculation/accept.py) ─► target.commit ─► drafter.observe(draft, out, path, correction)

Every decoding method is a drafter (methods/<name>/drafter.py): plain decoding proposes the root
alone; others fill a tree from the target's own outputs at the last accepted node, or from a model
of their own (a chain from a draft model's KV cache, the depths of a fused drafter). Acceptance,
the target's KV commit, stop rules, the fallback and the trace belong to the loop
(runtime/request/decode.py), the same for every method, so every method emits exactly the tokens plain
decoding would (greedy) or draws from the same target (sampling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from streamfuse.runtime.backends.base import StepOutput
from streamfuse.runtime.speculation.tree import TreeSpec


@dataclass(frozen=True)
class Draft:
    tree: TreeSpec | None  # the shape the target verifies; None: the root alone (a plain step)
    tokens: list[int]  # [T] node tokens, root first
    probs: np.ndarray | None = None  # [T, V] the distribution each node was drawn from (row 0 unused);
    #                                    None: deterministic drafts, accepted by matching the target's own draw
    from_lookup: int = 0  # lookup-branch nodes (from the top) that took prompt-lookup tokens
    calls: int = 0  # draft-model calls this draft cost (drafts from the target's own pass cost none)

    @classmethod
    def plain(cls, root: int) -> Draft:
        return cls(None, [root])

    @property
    def speculative(self) -> bool:
        return self.tree is not None


class Drafter(Protocol):
    name: str  # the method's (runtime/methods/registry.py)
    uses_streams: bool  # its drafts come out of the target's verify pass (StepOutput.stream_top)
    tree: TreeSpec | None  # the largest tree it proposes (sizes the KV scratch rows); None: plain

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        """A new run: the target has run the prompt and chosen `root` (not yet in its cache); `capacity`
        is the target's KV positions for the run. Returns the draft-model calls it made (a prefill)."""

    def propose(self, root: int) -> Draft:
        """The draft for the next target call; its root is `root`."""

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        """After the target committed `path` (nodes of `draft`) and chose `correction`, the next root.
        Plain steps of a speculative run (its fallback) arrive as Draft.plain(root), path [0]."""


def top_chain(tree: TreeSpec, tokens: Sequence[int]) -> list[int]:
    """Tokens of the all-rank-0 path below the root (what a chain draft would have proposed)."""
    chain, node = [], 0
    while True:
        child = next((c for c in tree.children[node] if tree.ranks[c] == 0), None)
        if child is None:
            return chain
        chain.append(tokens[child])
        node = child
