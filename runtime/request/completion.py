"""What a finished generation reports: its text, tokens, stop reason, statistics and run record (built once, by
runtime/request/slot.py's Slot.finish)."""

from __future__ import annotations

from dataclasses import dataclass

from streamfuse.runtime.request.trace import RunRecord


@dataclass(frozen=True)
class Stats:
    """What one generation cost and how speculation went."""

    new_tokens: int
    steps: int  # decode steps after the prefill, one target call each
    accepted_per_step: float  # draft tokens the target accepted per speculative step (0: plain decoding)
    model_calls: int  # target calls, the prefill's included
    seconds: float  # the whole generation, prefill included
    prefill_tokens: int  # prompt tokens prefilled: a conversation's turn prefills only what its cache lacks
    time_to_first_token: float  # seconds from the call to the first token (the prefill's)
    prompt_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_call(self) -> float:
        """New tokens per target call: the call reduction speculation buys (plain decoding: 1)."""
        return self.new_tokens / self.model_calls if self.model_calls else 0.0


@dataclass(frozen=True)
class Completion:
    """A finished generation: its text (special tokens skipped, cut where a stop string starts, stripped), the
    token ids the model emitted (a stop string's tokens included), why it stopped, and the run's record (each
    step's tokens and drafts, the phases' seconds, peak memory: what the tools report)."""

    text: str
    token_ids: list[int]
    stop_reason: str  # "eos", "stop_string" or "max_new_tokens"
    stats: Stats
    record: RunRecord
