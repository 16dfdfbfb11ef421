"""Falcon's drafter on the host: m passes of its one-layer semi-autoregressive model, k tokens each, draft the
top path of a static tree and its siblings (adapters/falcon.py has the model).

    start:   real rows = [(the prompt's last target state, root)]
    propose: fewer than k real rows (a run's first k - 1 steps for k > 1): a plain step. Else pass 1 runs the
             real rows the drafter's cache lacks and enough earlier ones to make a block of k (a one-layer
             drafter's K/V do not depend on the mask, so a re-run row writes what its slot already holds);
             the block's rows predict depths 1..k. Pass b runs the previous pass's predicted states with the
             top path's tokens at those depths as a block of k scratch rows (slots past the real rows,
             overwritten by the next pass 1) -> depths (b-1)k+1..bk. Node at depth d, rank r takes that depth's
             r-th token (greedy: top-k; sampling: drawn without replacement from the depth's q, accepted by
             the loop's multi-draft speculative sampling, runtime/accept.py).
    observe: the accepted nodes' target states (StepOutput.extras[HIDDEN]) with the tokens after them become
             real rows

The pass is an engine's (FalconPass): the drafter graph of the target's engine, or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from streamfuse.runtime.backends.base import HIDDEN, StepOutput
from streamfuse.runtime.drafter import Draft
from streamfuse.runtime.parallel_drafter import draw_children, kept_probs
from streamfuse.runtime.sampling import SamplingConfig, ranked
from streamfuse.runtime.stream_drafter import draft_tokens
from streamfuse.runtime.tree import TreeSpec


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
        raise ValueError(f"method falcon feeds each pass the tree's top path, and this tree lacks it at depth "
                         f"{nodes.index(None) + 1}: give a tree whose rank-0 path reaches its depth")
    return nodes


class FalconDrafter:
    name = "falcon"
    uses_streams = False

    def __init__(self, engine: FalconPass, tree: TreeSpec, sampling: SamplingConfig, seed: int,
                 max_passes: int | None = None):
        self.passes = math.ceil(tree.depth / engine.block)
        if max_passes is not None and self.passes > max_passes:
            raise ValueError(f"method falcon: a tree of depth {tree.depth} takes {self.passes} passes of "
                             f"{engine.block}, the drafter's graph has scratch for {max_passes}: give a tree of "
                             f"depth <= {max_passes * engine.block}")
        self.engine, self.tree, self.sampling, self.seed = engine, tree, sampling, seed
        self.top, self.width = top_path(tree), max(tree.widths)
        self.position = 0  # real row 0's position
        self.states: list[np.ndarray] = []  # real rows from index `first` on: the cache's last k and the new
        self.tokens: list[int] = []
        self.first = self.cached = 0
        self.generator: np.random.Generator | None = None

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.engine.reset()
        self.position, self.first, self.cached = len(prompt_ids) - 1, 0, 0
        self.states, self.tokens = [prefill.extras[HIDDEN][-1]], [root]
        self.generator = np.random.default_rng(self.seed + 3)  # its own: the target's draws stay plain decoding's
        return 0

    def propose(self, root: int) -> Draft:
        if self.tokens[-1] != root:
            raise RuntimeError(f"falcon: asked to draft after {root}, its last real row holds {self.tokens[-1]}")
        k, total = self.engine.block, self.first + len(self.tokens)
        if total < k:
            return Draft.plain(root)
        start = min(self.cached, total - k)
        rows = slice(start - self.first, None)
        features, logits = self.engine.run(np.stack(self.states[rows]), self.tokens[rows], self.position + start, start)
        self.cached = total
        self.states, self.tokens, self.first = self.states[-k:], self.tokens[-k:], total - k
        tokens = [root] + [0] * (self.tree.num_nodes - 1)
        probs = None if self.sampling.greedy else np.zeros((self.tree.num_nodes, self.engine.vocab_size))
        for index in range(self.passes):
            self._fill(tokens, probs, logits, 1 + index * k)
            if index + 1 < self.passes:
                top = [tokens[node] for node in self.top[index * k : (index + 1) * k]]
                features, logits = self.engine.run(features, top, self.position + total + index * k,
                                                   total + index * k)
        return Draft(self.tree, tokens, probs, calls=self.passes)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        hidden = out.extras[HIDDEN]
        self.states += [hidden[n] for n in path]
        self.tokens += [draft.tokens[n] for n in path[1:]] + [correction]

    def _fill(self, tokens: list[int], probs: np.ndarray | None, logits: np.ndarray, first_depth: int) -> None:
        """The nodes at depths first_depth.. first_depth + k - 1 from a pass's [k, D] logits (in place)."""
        logits = logits[: self.tree.depth - first_depth + 1]
        if probs is not None:
            q = kept_probs(logits, self.engine.vocab_ids, self.engine.vocab_size, self.sampling)
            draw_children(self.tree, tokens, probs, q, first_depth, self.generator)
            return
        table = np.zeros((self.tree.depth, self.width), dtype=np.int64)
        table[first_depth - 1 : first_depth - 1 + len(logits)] = self.engine.vocab_ids[ranked(logits, self.width)]
        filled = draft_tokens(self.tree, tokens[0], table)[0]
        for node, depth in enumerate(self.tree.depths):
            if first_depth <= depth < first_depth + len(logits):
                tokens[node] = filled[node]
