"""Medusa's drafter: heads on the target's last hidden state at the accepted node rank the same γ future tokens
SS's streams do, so they fill the same trees (methods/ss/drafter.py)."""

from __future__ import annotations

from collections.abc import Sequence

from streamfuse.methods.ss.drafter import StreamDrafter
from streamfuse.runtime.backends.base import HEAD_LOGITS, StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.speculation.lookup import PromptLookup
from streamfuse.runtime.speculation.sampling import ranked
from streamfuse.runtime.speculation.tree import TreeSpec


def heads_tree(ss_tree: TreeSpec, heads: int) -> TreeSpec:
    """Medusa drafts SS's calibrated tree (its graphs exist), cut to the heads' depth."""
    return TreeSpec(tuple(path for path in ss_tree.paths if len(path) <= heads))


class HeadDrafter(StreamDrafter):
    """Drafts `tree` from the heads the target's backend ranks at its accepted node (its streams never run).
    The heads run when a draft is proposed, so plain steps (the fallback) skip them. The tree's depth is at
    most the number of heads."""

    name = "medusa"
    uses_streams = False

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        if HEAD_LOGITS not in prefill.extras:
            raise ValueError(
                "method medusa needs Medusa heads on the target's backend (Loaded.drafter attaches the artifact's)"
            )
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
