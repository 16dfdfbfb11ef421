"""Plain decoding's drafter: every step verifies the root alone and emits the target's next token."""

from __future__ import annotations

from streamfuse.runtime.request.drafter import Draft


class PlainDrafter:
    name = "ar"
    uses_streams = False
    tree = None

    def start(self, prompt_ids, prefill, root, capacity) -> int:
        return 0

    def propose(self, root: int) -> Draft:
        return Draft.plain(root)

    def observe(self, draft, out, path, correction) -> None:
        pass
