"""Acceptance: which drafted path the target model agrees with. No I/O, no model.

`accept` (deterministic drafts: stream or head top-k, greedy draft models) walks down from the
root. At node n the target's next token is decided exactly as plain decoding would decide it
(argmax, or a draw from the target distribution); if a kept child of n carries that token, the
walk moves there, else the token becomes the correction. Every emitted token is therefore the
token plain decoding would produce (greedy) or a draw from the target conditional given the
accepted prefix (sampling): lossless either way, and with one seed the same tokens.

`accept_sampled` (a chain drawn from a draft model's distribution q) is standard speculative
sampling (Leviathan et al. 2023, Chen et al. 2023): draft x is kept with probability
min(1, p(x)/q(x)); the first rejected one is replaced by a draw from norm(max(0, p - q)), and a
fully accepted chain adds a draw from p. Each emitted token is distributed as p: lossless in
distribution, not draw for draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from streamfuse.runtime.sampling import draw
from streamfuse.runtime.tree import TreeSpec


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted node indices, root first
    correction: int  # the target's token after the last accepted node (next root)


def accept(tree: TreeSpec, tokens: Sequence[int], next_token: Callable[[int], int],
           kept: Sequence[bool] | None = None) -> Acceptance:
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


def accept_sampled(tree: TreeSpec, tokens: Sequence[int], probs: np.ndarray, target: Callable[[int], np.ndarray],
                   generator: np.random.Generator) -> Acceptance:
    """tree: a chain; tokens [T] drawn from probs [T, V] (row 0, the root, unused); target(n): [V]
    target probabilities after node n."""
    if any(len(kids) > 1 for kids in tree.children):
        raise ValueError("speculative sampling of drawn drafts takes a chain; a tree of drawn drafts needs "
                         "multi-draft acceptance")
    node, path = 0, [0]
    while True:
        p = target(node)
        if not tree.children[node]:
            return Acceptance(path, draw(p, generator))
        child = tree.children[node][0]
        token, q = tokens[child], probs[child]
        if generator.random() * float(q[token]) < float(p[token]):  # u < p/q
            path.append(child)
            node = child
            continue
        residual = np.maximum(p - q, 0)
        return Acceptance(path, draw(residual if residual.sum() > 0 else p, generator))
