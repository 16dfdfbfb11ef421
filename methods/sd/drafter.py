"""Two-model speculative decoding's drafter: a small draft model proposes a chain from its own KV cache.

    propose: feed the tokens the draft model has not seen (the last correction; after a fully
             accepted chain, also its last draft), then draw up to γ tokens one call each
    observe: roll the draft cache back to the accepted prefix; the correction is fed next time
Method sd drafts γ tokens every step. A stop rule (`Stop`; SpecDec++'s, methods/specdec/drafter.py) ends a chain
early: it reads the state at each fed draft and drafting stops once P(at least one rejection) = 1 - prod p_i
passes its threshold h; the token the same call proposes is kept (as the SpecDec++ authors' code does), so a
chain has 2..γ drafts.
The draft model runs on any Backend (its streams unused; the exported graphs return the final states
the rule reads): the runtime loads it on the target's engine (methods/sd/__init__.py). Greedy drafts are the
draft model's argmax and are accepted by matching the target's token; sampled drafts carry the draft
distribution q for speculative sampling
(runtime/speculation/accept.py), the standard rule of Leviathan et al. (2023) and Chen et al. (2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from streamfuse.runtime.backends.base import HIDDEN, Backend, StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import draw, target_probs
from streamfuse.runtime.speculation.tree import TreeSpec


class Stop(Protocol):
    """A chain's stop rule: drafting stops once the predicted probability of a rejection passes `threshold`."""

    method: str  # the method whose drafter stops by it
    threshold: float

    def accept_probability(self, hidden: np.ndarray) -> float:
        """[H] the draft model's final state at a fed draft -> P(the target accepts that draft)."""


class ModelDrafter:
    uses_streams = False

    def __init__(self, engine: Backend, settings: DecodeSettings, stop: Stop | None = None):
        self.name = stop.method if stop is not None else "sd"
        if settings.method != self.name:
            raise ValueError(f"this draft model drafts for method {self.name}, not {settings.method!r}")
        self.engine = engine
        self.tree = settings.tree  # the longest chain (DecodeSettings checks)
        self.gamma = settings.tree.depth
        self.chains = [TreeSpec.chain(n) if n else None for n in range(self.gamma + 1)]
        self.stop = stop
        self.sampling = settings.sampling
        self.seed = settings.seed
        self.generator: np.random.Generator | None = None  # seeded per run (start)
        self.pending: list[int] = []  # emitted tokens the draft cache lacks; the last is the current root
        self.length = 0  # rows in the draft cache
        self.base = 0  # its length once the pending tokens are in, before the drafts

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.engine.reset(capacity + self.gamma)
        self.generator = np.random.default_rng(self.seed + 1)  # its own: the target's draws stay plain decoding's
        self.engine.prefill(prompt_ids, with_streams=False)
        self.length, self.pending = len(prompt_ids), [root]
        return 1

    def propose(self, root: int) -> Draft:
        calls = len(self.pending)
        out = self._feed(self.pending)
        self.base, self.pending = self.length, []
        tokens, probs, survive = [root], [], 1.0
        while True:
            token, q = self._draw(out.main_logits[0])
            tokens.append(token)
            probs.append(q)
            if len(tokens) > self.gamma:
                break
            out = self._feed([token])
            calls += 1
            if self.stop is not None:
                survive *= self.stop.accept_probability(out.extras[HIDDEN][0])
                if 1.0 - survive > self.stop.threshold:
                    token, q = self._draw(out.main_logits[0])  # proposed by the same call: kept
                    tokens.append(token)
                    probs.append(q)
                    break
        drafted = None if self.sampling.greedy else np.stack([np.zeros_like(probs[0]), *probs])
        return Draft(self.chains[len(tokens) - 1], tokens, drafted, calls=calls)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        if not draft.speculative:  # a plain step (the fallback): its root was pending already
            self.pending.append(correction)
            return
        accepted = len(path) - 1
        fed = min(accepted, len(draft.tokens) - 2)  # the chain's last draft was never fed
        self.length = self.base + fed
        self.engine.rollback(self.length)
        self.pending = draft.tokens[1 + fed : 1 + accepted] + [correction]

    def _feed(self, tokens: Sequence[int]) -> StepOutput:
        """Append tokens to the draft cache one call each; the output of the last."""
        for token in tokens:
            out = self.engine.step([token], None, with_streams=False)
            self.engine.commit([0])
            self.length += 1
        return out

    def _draw(self, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        if self.sampling.greedy:
            return int(np.argmax(logits)), None
        q = target_probs(logits, self.sampling)
        return draw(q, self.generator), q
