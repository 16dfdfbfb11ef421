"""The host loop Falcon's and ParallelSpec's drafters share: a one-layer fused drafter model reads real rows (a
target state and the token after it) and drafts depths of a static tree, its passes an engine's (the drafter graph
of the target's engine, or torch: methods/fused/graph_pass.py, torch_pass.py).

    start:   real rows = [(the prompt's last target state, root)]
    propose: the method's passes over the real rows its cache lacks -> logits per depth; node at depth d, rank r
             takes that depth's r-th token (greedy: top-k; sampling: siblings drawn without replacement from the
             depth's q, accepted by the loop's multi-draft speculative sampling, runtime/speculation/accept.py)
    observe: the accepted nodes' target states (StepOutput.extras[HIDDEN]) with the tokens after them (the next
             node's, the correction) become real rows
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamfuse.methods.ss.drafter import draft_tokens
from streamfuse.runtime.backends.base import HIDDEN, StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.sampling import SamplingConfig, draw, ranked, target_probs
from streamfuse.runtime.speculation.tree import TreeSpec


def kept_probs(logits: np.ndarray, vocab_ids: np.ndarray, vocab_size: int, sampling: SamplingConfig) -> np.ndarray:
    """[N, D] logits over a drafter's kept columns -> [N, V] its q over the target's vocabulary (zero elsewhere)."""
    full = np.full((len(logits), vocab_size), -np.inf, dtype=np.float32)
    full[:, vocab_ids] = logits
    return np.stack([target_probs(row, sampling) for row in full])


def draw_children(
    tree: TreeSpec,
    tokens: list[int],
    probs: np.ndarray,
    q: np.ndarray,
    first_depth: int,
    generator: np.random.Generator,
) -> None:
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


class PassDrafter:
    """The shared state and steps; a method's subclass says how its passes make a draft (`propose`)."""

    name: str
    seed_offset: int  # its generator's seed past the run's: its own, so the target's draws stay plain decoding's
    uses_streams = False

    def __init__(self, engine, tree: TreeSpec, sampling: SamplingConfig, seed: int):
        self.engine, self.tree, self.sampling, self.seed = engine, tree, sampling, seed
        self.width = max(tree.widths)
        self.position = 0  # the first real row's position
        self.states: list[np.ndarray] = []  # real rows: target states [H] ...
        self.tokens: list[int] = []  # ... and the tokens after them
        self.generator: np.random.Generator | None = None

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.engine.reset()
        self.position = len(prompt_ids) - 1
        self.states, self.tokens = [prefill.extras[HIDDEN][-1]], [root]
        self.generator = np.random.default_rng(self.seed + self.seed_offset)
        return 0

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        hidden = out.extras[HIDDEN]  # plain steps (no propose) add up until the next pass
        self.states += [hidden[n] for n in path]
        self.tokens += [draft.tokens[n] for n in path[1:]] + [correction]

    def check_root(self, root: int) -> None:
        if self.tokens[-1] != root:
            raise RuntimeError(f"{self.name}: asked to draft after {root}, its last real row holds {self.tokens[-1]}")

    def blank(self, root: int) -> tuple[list[int], np.ndarray | None]:
        """A draft to fill: the root then placeholders; the q of each node when sampling (row 0 unused)."""
        size = self.tree.num_nodes
        return [root] + [0] * (size - 1), None if self.sampling.greedy else np.zeros((size, self.engine.vocab_size))

    def fill(self, tokens: list[int], probs: np.ndarray | None, logits: np.ndarray, first_depth: int) -> None:
        """The nodes at depths first_depth.. from a pass's [N, D] logits, one row a depth (in place)."""
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
