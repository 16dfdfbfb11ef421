"""ParallelSpec's drafter on the host: one pass of its one-layer model drafts every depth of a static tree
(adapters/parallelspec.py has the model).

    start:   pending real rows = [(the prompt's last target state, root)]
    propose: one pass over the pending real rows + k [MASK] rows -> k + 1 depth rows of logits; the real
             rows' K/V stay in the drafter's cache; node at depth d with rank r takes row d's r-th token
             (greedy: its top-k; sampling: siblings drawn without replacement from row d's q, which the
             loop's multi-draft speculative sampling accepts, runtime/accept.py)
    observe: the accepted nodes' target states (StepOutput.extras[HIDDEN]) with the tokens after them (the
             next node's, the correction) become the next pending real rows

The pass is an engine's (ParallelPass): the drafter graph of the target's engine, or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from streamfuse.runtime.backends.base import HIDDEN, StepOutput
from streamfuse.runtime.drafter import Draft
from streamfuse.runtime.sampling import SamplingConfig, draw, ranked, target_probs
from streamfuse.runtime.stream_drafter import draft_tokens
from streamfuse.runtime.tree import TreeSpec


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


class ParallelDrafter:
    name = "parallelspec"
    uses_streams = False

    def __init__(self, engine: ParallelPass, tree: TreeSpec, sampling: SamplingConfig, seed: int):
        if tree.depth > engine.masks + 1:
            raise ValueError(f"method parallelspec drafts {engine.masks + 1} depths in a pass, the tree has "
                             f"{tree.depth}: give a tree of depth <= {engine.masks + 1}")
        self.engine, self.tree, self.sampling, self.seed = engine, tree, sampling, seed
        self.width = max(tree.widths)
        self.position = 0  # the next pending real row's position
        self.pending: tuple[list[np.ndarray], list[int]] = ([], [])
        self.generator: np.random.Generator | None = None

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.engine.reset()
        self.position = len(prompt_ids) - 1
        self.pending = ([prefill.extras[HIDDEN][-1]], [root])
        self.generator = np.random.default_rng(self.seed + 2)  # its own: the target's draws stay plain decoding's
        return 0

    def propose(self, root: int) -> Draft:
        states, tokens = self.pending
        if tokens[-1] != root:
            raise RuntimeError(f"parallelspec: asked to draft after {root}, its last real row holds {tokens[-1]}")
        logits = self.engine.run(np.stack(states), tokens, self.position)[: self.tree.depth]
        self.position += len(tokens)
        self.pending = ([], [])
        if self.sampling.greedy:
            columns = ranked(logits, self.width)
            return Draft(self.tree, draft_tokens(self.tree, root, self.engine.vocab_ids[columns])[0], calls=1)
        return self._sampled(root, logits)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        states, tokens = self.pending  # plain steps (no propose) add up until the next pass
        hidden = out.extras[HIDDEN]
        states += [hidden[n] for n in path]
        tokens += [draft.tokens[n] for n in path[1:]] + [correction]

    def _sampled(self, root: int, logits: np.ndarray) -> Draft:
        q = kept_probs(logits, self.engine.vocab_ids, self.engine.vocab_size, self.sampling)
        tokens, probs = [root] + [0] * (self.tree.num_nodes - 1), np.zeros((self.tree.num_nodes, q.shape[1]))
        draw_children(self.tree, tokens, probs, q, 1, self.generator)
        return Draft(self.tree, tokens, probs, calls=1)


def kept_probs(logits: np.ndarray, vocab_ids: np.ndarray, vocab_size: int, sampling: SamplingConfig) -> np.ndarray:
    """[N, D] logits over a drafter's kept columns -> [N, V] its q over the target's vocabulary (zero elsewhere)."""
    full = np.full((len(logits), vocab_size), -np.inf, dtype=np.float32)
    full[:, vocab_ids] = logits
    return np.stack([target_probs(row, sampling) for row in full])


def draw_children(tree: TreeSpec, tokens: list[int], probs: np.ndarray, q: np.ndarray, first_depth: int,
                  generator: np.random.Generator) -> None:
    """Fill the nodes at depths first_depth.. first_depth + len(q) - 1 (in place): each node's children drawn
    without replacement from their depth's q (q[depth - first_depth]), probs[child] the q it was drawn from."""
    for children in tree.children:
        left = None
        for child in sorted(children, key=lambda c: tree.ranks[c]):
            row = tree.depths[child] - first_depth
            if not 0 <= row < len(q):
                break
            left = q[row].astype(np.float64) if left is None else left
            if left.sum() <= 0:  # q has fewer tokens than the node has children: the rest hold no draft
                break
            tokens[child] = draw(left, generator)
            probs[child] = q[row]
            left = left.copy()
            left[tokens[child]] = 0.0
