"""Drafts that come out of the target's own pass: Speculative Streaming's streams.

The target's verify pass also runs the γ streams (fused, or deferred after the commit), so the
next draft costs no extra model call: node at depth d with rank r takes stream d's r-th most
likely token. A lookup branch, if the tree has one, takes prompt-lookup tokens instead
(runtime/speculation/lookup.py). `draft_tokens` fills any tree from per-depth ranked tokens: the methods that
rank the same depths another way (heads, a drafter model) fill their trees with it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamfuse.runtime.backends.base import StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.lookup import PromptLookup
from streamfuse.runtime.speculation.tree import TreeSpec


def draft_tokens(tree: TreeSpec, root: int, ranked: np.ndarray, looked_up: Sequence[int] = ()) -> tuple[list[int], int]:
    """Fill the tree: node at depth d with rank r takes stream d's r-th most likely token.
    ranked: [gamma, K] token ids of each stream, best first (K >= the tree's widest level).
    looked_up: prompt-lookup tokens for the tree's lookup branch, shallowest first.
    Returns the node tokens and how many lookup-branch nodes (from the top) took lookup tokens."""
    top = ranked.tolist()
    tokens = [root] + [top[depth - 1][rank] for depth, rank in zip(tree.depths[1:], tree.ranks[1:])]
    return tokens, _fill_lookup(tree, tokens, looked_up)


def _fill_lookup(tree: TreeSpec, tokens: list[int], looked_up: Sequence[int]) -> int:
    """Put lookup tokens on the lookup branch (in place), stopping at the first that repeats a
    sibling's token: acceptance takes the first matching child, so siblings must stay distinct
    (and a repeated sibling adds nothing). Below that point the branch keeps its stream tokens."""
    filled = 0
    for node, token in zip(tree.lookup_nodes, looked_up):
        siblings = tree.children[tree.parents[node]]
        if any(tokens[s] == token for s in siblings if s != node):
            break
        tokens[node] = token
        filled += 1
    return filled


class StreamDrafter:
    """Drafts `tree` from the streams the target's last verify pass ranked at its accepted node."""

    name = "ss"
    uses_streams = True

    def __init__(self, tree: TreeSpec, num_streams: int):
        tree.check_streams(num_streams)
        self.tree = tree
        self.width = max(tree.widths)
        self.streams: np.ndarray | None = None  # [gamma, width] ranked stream tokens at the last accepted node
        self.lookup: PromptLookup | None = None

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.streams = prefill.stream_top(0, self.width)
        self.lookup = PromptLookup([*prompt_ids, root]) if self.tree.lookup else None
        return 0

    def propose(self, root: int) -> Draft:
        lookup = self.lookup.draft(len(self.tree.lookup)) if self.lookup is not None else ()
        tokens, filled = draft_tokens(self.tree, root, self.streams, lookup)
        return Draft(self.tree, tokens, from_lookup=filled)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        if out.stream_logits is not None or out.ranked_drafts is not None:
            self.streams = out.stream_top(path[-1], self.width)
        self._extend_lookup(draft, path, correction)

    def _extend_lookup(self, draft: Draft, path: Sequence[int], correction: int) -> None:
        if self.lookup is not None:
            self.lookup.extend([draft.tokens[n] for n in path[1:]] + [correction])
