"""Falcon's drafter on the host: m passes of its one-layer semi-autoregressive model, k tokens each, draft the
top path of a static tree and its siblings (methods/falcon/model.py has the model; methods/fused/drafter.py the
loop it shares with ParallelSpec).

    propose: fewer than k real rows (a run's first k - 1 steps for k > 1): a plain step. Else pass 1 runs the
             real rows the drafter's cache lacks and enough earlier ones to make a block of k (a one-layer
             drafter's K/V do not depend on the mask, so a re-run row writes what its slot already holds);
             the block's rows predict depths 1..k. Pass b runs the previous pass's predicted states with the
             top path's tokens at those depths as a block of k scratch rows (slots past the real rows,
             overwritten by the next pass 1) -> depths (b-1)k+1..bk.

The pass is an engine's (FalconPass): the drafter graph of the target's engine, or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from streamfuse.methods.fused.drafter import PassDrafter
from streamfuse.runtime.backends.base import StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec


def block_visibility(slot: int, slots: int, real: int, rows: int, block: int) -> np.ndarray:
    """[rows, slots + rows] bool: what each row of a pass sees, over (the cache's `slots`, this pass's rows).
    The pass's `real` rows (then pad rows up to `rows`) see cache slots < slot and this pass's rows up to
    themselves, the last `block` of them each other (the relaxed causal mask); a pad row only itself."""
    visible = np.zeros((rows, slots + rows), dtype=bool)
    visible[:real, :slot] = True
    inside = np.tril(np.ones((real, real), dtype=bool))
    inside[real - min(block, real) :, real - min(block, real) :] = True
    visible[:real, slots : slots + real] = inside
    pads = np.arange(real, rows)
    visible[pads, slots + pads] = True
    return visible


class FalconPass(Protocol):
    block: int  # k: rows of a block, tokens a pass drafts
    vocab_ids: np.ndarray  # [D] the token id of each logits column, ascending
    vocab_size: int  # V, the target's

    def reset(self) -> None:
        """Empty the drafter's cache."""

    def run(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows (states [R, H], the tokens after them [R]) at positions position.. write their K/V to cache
        slots slot.. and see the slots below it (block_visibility) -> the last k rows' (predicted states
        [k, H], logits [k, D])."""


def top_path(tree: TreeSpec) -> list[int]:
    """[depth] the node of each depth's all-rank-0 path (a pass's block feeds the next with those tokens)."""
    index = {path: node for node, path in enumerate(((),) + tree.paths)}
    nodes = [index.get((0,) * depth) for depth in range(1, tree.depth + 1)]
    if None in nodes:
        raise ValueError(
            f"method falcon feeds each pass the tree's top path, and this tree lacks it at depth "
            f"{nodes.index(None) + 1}: give a tree whose rank-0 path reaches its depth"
        )
    return nodes


class FalconDrafter(PassDrafter):
    name = "falcon"
    seed_offset = 3

    def __init__(
        self, engine: FalconPass, tree: TreeSpec, sampling: SamplingConfig, seed: int, max_passes: int | None = None
    ):
        self.passes = math.ceil(tree.depth / engine.block)
        if max_passes is not None and self.passes > max_passes:
            raise ValueError(
                f"method falcon: a tree of depth {tree.depth} takes {self.passes} passes of "
                f"{engine.block}, the drafter's graph has scratch for {max_passes}: give a tree of "
                f"depth <= {max_passes * engine.block}"
            )
        super().__init__(engine, tree, sampling, seed)
        self.top = top_path(tree)
        self.first = self.cached = 0  # states[0]'s row index; real rows in the drafter's cache

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.first = self.cached = 0
        return super().start(prompt_ids, prefill, root, capacity)

    def propose(self, root: int) -> Draft:
        self.check_root(root)
        k, total = self.engine.block, self.first + len(self.tokens)
        if total < k:
            return Draft.plain(root)
        start = min(self.cached, total - k)
        rows = slice(start - self.first, None)
        features, logits = self.engine.run(np.stack(self.states[rows]), self.tokens[rows], self.position + start, start)
        self.cached = total
        self.states, self.tokens, self.first = self.states[-k:], self.tokens[-k:], total - k  # the cache's last k
        tokens, probs = self.blank(root)
        for index in range(self.passes):
            self.fill(tokens, probs, logits, 1 + index * k)
            if index + 1 < self.passes:
                top = [tokens[node] for node in self.top[index * k : (index + 1) * k]]
                features, logits = self.engine.run(features, top, self.position + total + index * k, total + index * k)
        return Draft(self.tree, tokens, probs, calls=self.passes)
