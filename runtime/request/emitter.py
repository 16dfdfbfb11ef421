"""Token emission with stop rules applied one token at a time.

Speculative steps deliver several tokens at once; checking stops token by token makes a
speculative run stop at exactly the token where plain decoding stops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StopRules:
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")


@dataclass
class Emitter:
    rules: StopRules
    detokenizer: Callable[[Sequence[int]], str] | None = None  # needed only for stop strings
    tokens: list[int] = field(default_factory=list)
    stop_reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    def emit(self, new_tokens: Sequence[int]) -> list[int]:
        """Append tokens until a stop fires; returns the tokens actually emitted."""
        emitted = []
        for token in new_tokens:
            if self.done:
                break
            self.tokens.append(token)
            emitted.append(token)
            self.stop_reason = self._stop_after(token)
        return emitted

    def _stop_after(self, token: int) -> str:
        if token in self.rules.stop_token_ids:
            return "eos"
        if self.rules.stop_strings and self.detokenizer is not None:
            tail = self._tail()
            if any(stop in tail for stop in self.rules.stop_strings):
                return "stop_string"
        if len(self.tokens) >= self.rules.max_new_tokens:
            return "max_new_tokens"
        return ""

    def _tail(self) -> str:
        """The decoded end of the tokens, long enough to hold any stop string that the newest token completed:
        the longest stop string plus the newest token's own text (a stop string of any length is found; the
        window doubles from 16 tokens, so short stops cost one short decode)."""
        need = max(map(len, self.rules.stop_strings)) + len(self.detokenizer(self.tokens[-1:]))
        size = 16
        while True:
            tail = self.detokenizer(self.tokens[-size:])
            if len(tail) >= need or size >= len(self.tokens):
                return tail
            size *= 2
