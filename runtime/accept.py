"""Tree acceptance: which drafted path the target model agrees with. No I/O, no model.

Both rules walk down from the root. At node n the target's next token is decided exactly as
plain decoding would decide it (argmax, or a draw from the target distribution); if a kept
child of n carries that token, the walk moves there, else the token becomes the correction.
Every emitted token is therefore the token plain decoding would produce (greedy) or a draw from
the target conditional given the accepted prefix (sampling): lossless either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
