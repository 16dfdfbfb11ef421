"""Drafts that come out of the target's own pass: Speculative Streaming's streams, Medusa's heads.

The target's verify pass also runs the γ streams (fused, or deferred after the commit), so the
next draft costs no extra model call: node at depth d with rank r takes stream d's r-th most
likely token. A lookup branch, if the tree has one, takes prompt-lookup tokens instead
(runtime/lookup.py). Medusa heads rank the same γ future tokens from the target's last hidden
state at the accepted node (HeadDrafter), so they fill the same trees. Method ss-adaptive
(AdaptiveStreamDrafter) drafts SS's streams too, into the tree its acceptance head picks per step
among the calibrated ones (runtime/tree_choice.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamfuse.runtime.acceptance_head import AcceptancePredictor
from streamfuse.runtime.backends.base import HEAD_LOGITS, STREAM_STATES, StepOutput
from streamfuse.runtime.drafter import Draft
from streamfuse.runtime.lookup import PromptLookup
from streamfuse.runtime.sampling import ranked
from streamfuse.runtime.tree import TreeSpec
from streamfuse.runtime.tree_choice import TreeChoice


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


def top_chain(tree: TreeSpec, tokens: Sequence[int]) -> list[int]:
    """Tokens of the all-rank-0 path below the root (what a chain draft would have proposed)."""
    chain, node = [], 0
    while True:
        child = next((c for c in tree.children[node] if tree.ranks[c] == 0), None)
        if child is None:
            return chain
        chain.append(tokens[child])
        node = child


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


def heads_tree(ss_tree: TreeSpec, heads: int) -> TreeSpec:
    """Medusa drafts SS's calibrated tree (its graphs exist), cut to the heads' depth."""
    return TreeSpec(tuple(path for path in ss_tree.paths if len(path) <= heads))


class HeadDrafter(StreamDrafter):
    """Medusa: drafts `tree` from the heads the target's backend ranks at its accepted node (its
    streams never run). The heads run when a draft is proposed, so plain steps (the fallback) skip
    them. The tree's depth is at most the number of heads."""

    name = "medusa"
    uses_streams = False

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        if HEAD_LOGITS not in prefill.extras:
            raise ValueError("method medusa needs Medusa heads on the target's backend (Loaded.drafter attaches the "
                             "artifact's)")
        self.source = (prefill, 0)
        self.lookup = PromptLookup([*prompt_ids, root]) if self.tree.lookup else None
        return 0

    def propose(self, root: int) -> Draft:
        out, node = self.source
        self.streams = ranked(out.extras[HEAD_LOGITS](node), self.width)
        return super().propose(root)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        self.source = (out, path[-1])
        self._extend_lookup(draft, path, correction)


class AdaptiveStreamDrafter(StreamDrafter):
    """ss-adaptive: SS's streams, each step in the tree `choice` picks from the acceptance head's reading
    of the streams' states at the accepted node. `tree` is the largest candidate (the KV scratch rows)."""

    name = "ss-adaptive"

    def __init__(self, choice: TreeChoice, head: AcceptancePredictor, num_streams: int):
        super().__init__(choice.largest, num_streams)
        for candidate in choice.candidates:
            candidate.tree.check_streams(num_streams)
        self.choice, self.head = choice, head
        self.width = max(max(c.tree.widths) for c in choice.candidates)
        self.lookup_length = max(len(c.tree.lookup) for c in choice.candidates)
        self.states: np.ndarray | None = None  # [gamma, H] the streams' final states at the last accepted node

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.streams, self.states = prefill.stream_top(0, self.width), prefill.extras[STREAM_STATES](0)
        self.lookup = PromptLookup([*prompt_ids, root]) if self.lookup_length else None
        return 0

    def propose(self, root: int) -> Draft:
        tree = self.choice.choose(self.head.probability(self.states).tolist())
        lookup = self.lookup.draft(len(tree.lookup)) if self.lookup is not None and tree.lookup else ()
        tokens, filled = draft_tokens(tree, root, self.streams, lookup)
        return Draft(tree, tokens, from_lookup=filled)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        if STREAM_STATES in out.extras:
            self.streams, self.states = out.stream_top(path[-1], self.width), out.extras[STREAM_STATES](path[-1])
        self._extend_lookup(draft, path, correction)
