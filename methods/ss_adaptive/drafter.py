"""ss-adaptive's drafter: SS's streams (methods/ss/drafter.py), each step in the tree its acceptance head picks
among the calibrated ones (runtime/speculation/tree_choice.py) from its reading of the streams' states."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamfuse.methods.ss.drafter import StreamDrafter, draft_tokens
from streamfuse.runtime.backends.base import STREAM_STATES, StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.acceptance_head import AcceptancePredictor
from streamfuse.runtime.speculation.lookup import PromptLookup
from streamfuse.runtime.speculation.tree_choice import TreeChoice


class AdaptiveStreamDrafter(StreamDrafter):
    """SS's streams, each step in the tree `choice` picks from the acceptance head's reading of the streams'
    states at the accepted node. `tree` is the largest candidate (the KV scratch rows)."""

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
