"""Two-model speculative decoding's drafter: a small draft model proposes a chain from its own KV cache.

    propose: feed the tokens the draft model has not seen (the last correction; after a fully
             accepted chain, also its last draft), then draw γ tokens one call each
    observe: roll the draft cache back to the accepted prefix; the correction is fed next time
The draft model runs on any Backend (its streams unused): the runtime loads it on torch
(Loaded.drafter). Greedy drafts are the draft model's argmax and are accepted by matching the target's
token; sampled drafts carry the draft distribution q for speculative sampling
(runtime/accept.py), the standard rule of Leviathan et al. (2023) and Chen et al. (2023).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamfuse.runtime.backends.base import Backend, StepOutput
from streamfuse.runtime.drafter import Draft
from streamfuse.runtime.sampling import target_probs
from streamfuse.runtime.settings import DecodeSettings


class ModelDrafter:
    name = "sd"
    uses_streams = False

    def __init__(self, engine: Backend, settings: DecodeSettings):
        if settings.method != self.name:
            raise ValueError(f"a draft model drafts for method sd, not {settings.method!r}")
        self.engine = engine
        self.tree = settings.tree  # a chain (DecodeSettings checks)
        self.gamma = settings.tree.depth
        self.sampling = settings.sampling
        self.seed = settings.seed
        self.generator = torch.Generator()
        self.pending: list[int] = []  # emitted tokens the draft cache lacks; the last is the current root
        self.length = 0  # rows in the draft cache
        self.base = 0  # its length once the pending tokens are in, before the drafts

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.engine.reset(capacity + self.gamma)
        self.generator.manual_seed(self.seed + 1)  # its own stream: the target's draws stay plain decoding's
        self.engine.prefill(prompt_ids, with_streams=False)
        self.length, self.pending = len(prompt_ids), [root]
        return 1

    def propose(self, root: int) -> Draft:
        calls = len(self.pending) + self.gamma - 1
        logits = self._feed(self.pending)
        self.base, self.pending = self.length, []
        tokens, probs = [root], []
        for index in range(self.gamma):
            token, q = self._draw(logits)
            tokens.append(token)
            probs.append(q)
            if index + 1 < self.gamma:
                logits = self._feed([token])
        drafted = None if self.sampling.greedy else torch.stack([torch.zeros_like(probs[0]), *probs])
        return Draft(self.tree, tokens, drafted, calls=calls)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        if not draft.speculative:  # a plain step (the fallback): its root was pending already
            self.pending.append(correction)
            return
        accepted = len(path) - 1
        fed = min(accepted, self.gamma - 1)  # the chain's last draft was never fed
        self.length = self.base + fed
        self.engine.rollback(self.length)
        self.pending = draft.tokens[1 + fed : 1 + accepted] + [correction]

    def _feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append tokens to the draft cache one call each; the logits after the last."""
        for token in tokens:
            out = self.engine.step([token], None, with_streams=False)
            self.engine.commit([0])
            self.length += 1
        return out.main_logits[0]

    def _draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.sampling.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits, self.sampling)
        return int(torch.multinomial(q, 1, generator=self.generator)), q
