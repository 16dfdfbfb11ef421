"""ParallelSpec's drafter on the host: one pass of its one-layer model drafts every depth of a static tree
(methods/parallelspec/model.py has the model; methods/fused/drafter.py the loop it shares with Falcon).

    propose: one pass over the real rows the drafter's cache lacks + k [MASK] rows -> k + 1 depth rows of
             logits; the real rows' K/V stay in the drafter's cache, so the next pass takes the new rows only

The pass is an engine's (ParallelPass): the drafter graph of the target's engine, or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from streamfuse.methods.fused.drafter import PassDrafter
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec


def pass_visibility(cached: int, slots: int, real: int, rows: int, masks: int) -> np.ndarray:
    """[rows + masks, slots + rows + masks] bool: what each row of a pass sees, over (the cache's `slots`, this
    pass's rows). The cache holds `cached` rows; the pass has `real` real rows, then pad rows up to `rows`, then
    the masks. Real rows see the cache and the real rows up to themselves; [MASK]_j the cache, every real row
    and [MASK]_1..j; a pad row only itself."""
    visible = np.zeros((rows + masks, slots + rows + masks), dtype=bool)
    visible[:real, :cached] = visible[rows:, :cached] = True
    visible[:real, slots : slots + real] = np.tril(np.ones((real, real), dtype=bool))
    visible[rows:, slots : slots + real] = True
    visible[rows:, slots + rows :] = np.tril(np.ones((masks, masks), dtype=bool))
    pads = np.arange(real, rows)
    visible[pads, slots + pads] = True
    return visible


class ParallelPass(Protocol):
    masks: int  # [MASK] rows per pass: it drafts masks + 1 depths
    vocab_ids: np.ndarray  # [D] the token id of each logits column, ascending
    vocab_size: int  # V, the target's

    def reset(self) -> None:
        """Empty the drafter's cache (its size is the engine's: a graph's is static, torch's grows)."""

    def run(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        """Real rows (states [R, H], the tokens after them [R]) at positions position.., then the masks ->
        [masks + 1, D] logits (the last real row's, then each mask's); the real rows join the cache."""


class ParallelDrafter(PassDrafter):
    name = "parallelspec"
    seed_offset = 2

    def __init__(self, engine: ParallelPass, tree: TreeSpec, sampling: SamplingConfig, seed: int):
        if tree.depth > engine.masks + 1:
            raise ValueError(
                f"method parallelspec drafts {engine.masks + 1} depths in a pass, the tree has "
                f"{tree.depth}: give a tree of depth <= {engine.masks + 1}"
            )
        super().__init__(engine, tree, sampling, seed)

    def propose(self, root: int) -> Draft:
        self.check_root(root)
        logits = self.engine.run(np.stack(self.states), self.tokens, self.position)
        self.position += len(self.tokens)
        self.states, self.tokens = [], []  # in the drafter's cache now
        tokens, probs = self.blank(root)
        self.fill(tokens, probs, logits, 1)
        return Draft(self.tree, tokens, probs, calls=1)
