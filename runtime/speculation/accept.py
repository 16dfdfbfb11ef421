"""Acceptance: which drafted path the target model agrees with. No I/O, no model.

`accept` (deterministic drafts: stream or head top-k, greedy draft models) walks down from the
root. At node n the target's next token is decided exactly as plain decoding would decide it
(argmax, or a draw from the target distribution); if a kept child of n carries that token, the
walk moves there, else the token becomes the correction. Every emitted token is therefore the
token plain decoding would produce (greedy) or a draw from the target conditional given the
accepted prefix (sampling): lossless either way, and with one seed the same tokens.

`accept_sampled` (drafts drawn from a draft distribution q: a draft model's chain, or a tree whose
siblings were drawn without replacement) is speculative sampling (Leviathan et al. 2023, Chen et al.
2023; for trees, recursive rejection sampling): draft x is kept with probability min(1, p(x)/q(x));
after a rejection the next sibling is tried against norm(max(0, p - q)), and when none is left the
correction is a draw from that residual; a fully accepted path adds a draw from p. Each emitted token
is distributed as p: lossless in distribution, not draw for draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from streamfuse.runtime.speculation.sampling import draw
from streamfuse.runtime.speculation.tree import TreeSpec


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root first
    correction: int  # the target's token after the last accepted node (next root)


def accept(
    tree: TreeSpec, tokens: Sequence[int], next_token: Callable[[int], int], kept: Sequence[bool] | None = None
) -> Acceptance:
    """tokens [T] of the tree nodes; next_token(n) is the target's token after node n (called
    once per visited node, in order, so a sampler draws exactly as plain decoding would);
    kept [T] marks nodes not pruned (None: all)."""
    node, path = 0, [0]
    while True:
        token = next_token(node)
        child = next((c for c in tree.children[node] if tokens[c] == token and (kept is None or kept[c])), None)
        if child is None:
            return Acceptance(path, token)
        path.append(child)
        node = child


def accept_sampled(
    tree: TreeSpec,
    tokens: Sequence[int],
    probs: np.ndarray,
    target: Callable[[int], np.ndarray],
    generator: np.random.Generator,
) -> Acceptance:
    """tokens [T] of the nodes; the children of a node were drawn without replacement from one q, its rows
    probs[child] [V] (row 0, the root, unused); target(n): [V] target probabilities after node n.

    Multi-draft speculative sampling (SpecInfer; Jeon et al. 2024, recursive rejection sampling): child x is
    kept with probability min(1, p(x)/q(x)); after a rejection p becomes norm(max(0, p - q)) and q loses x
    (zeroed, renormalised: the next sibling was drawn without it), and the next child is tried; when none is
    left, the correction is drawn from the current p. A chain is standard speculative sampling."""
    node, path = 0, [0]
    while True:
        p = target(node)
        child = _sampled_child(tree.children[node], tokens, probs, p, generator)
        if isinstance(child, Acceptance):
            return Acceptance(path, child.correction)
        if child is None:
            return Acceptance(path, draw(p, generator))
        path.append(child)
        node = child


def _sampled_child(
    children: Sequence[int], tokens: Sequence[int], probs: np.ndarray, p: np.ndarray, generator: np.random.Generator
) -> int | Acceptance | None:
    """The kept child, or (every child rejected) an Acceptance carrying the correction drawn from the residual,
    or None (a leaf: the caller draws from p)."""
    q = None
    for index, child in enumerate(children):
        token = tokens[child]
        q = np.array(probs[child], dtype=np.float64) if q is None else q
        if generator.random() * float(q[token]) < float(p[token]):  # u < p/q
            return child
        residual = np.maximum(p - q, 0)
        if residual.sum() <= 0:  # p == q up to rounding: the residual is p itself
            residual = np.asarray(p, dtype=np.float64)
        if index == len(children) - 1:
            return Acceptance([], draw(residual, generator))
        q[token] = 0.0
        if q.sum() <= 0:  # q had no other token to draw: the remaining children hold no draft
            return Acceptance([], draw(residual, generator))
        p = residual / residual.sum()
        q /= q.sum()
    return None
