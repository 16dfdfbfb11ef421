"""Step events -> marked-up text segments, as in the paper's figures 11-12.

Each speculative step shows the draft tokens it accepted, the top-1 draft tokens it rejected
(struck through, never part of the output) and the target model's own correction token.
Plain decoding and the prefill emit unmarked tokens. Qt-free, so it is unit-testable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from streamfuse.runtime.request.decode import StepEvent

ACCEPTED, REJECTED, CORRECTION, PLAIN = "accepted", "rejected", "correction", "plain"


@dataclass(frozen=True)
class Style:
    foreground: str | None = None  # "#rrggbb"
    background: str | None = None
    bold: bool = False
    strike: bool = False


STYLES = {
    ACCEPTED: Style(foreground="#14532d", background="#bbf7d0"),
    REJECTED: Style(foreground="#dc2626", strike=True),
    CORRECTION: Style(bold=True),
    PLAIN: Style(),
}
LEGEND = {ACCEPTED: "accepted draft", REJECTED: "rejected draft", CORRECTION: "correction (target model)"}


@dataclass(frozen=True)
class Segment:
    kind: str  # one of STYLES
    text: str


class SegmentBuilder:
    """Turns the step events of one generation into segments, decoding incrementally.

    Text is cut from the decode of the whole output so far: decoding tokens one by one would
    lose the spaces and multi-byte characters that byte-level BPE spreads over tokens."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.text = ""  # the output text so far (rejected drafts excluded)

    def add(self, event: StepEvent) -> list[Segment]:
        accepted = list(event.tokens[: event.accepted_drafts])
        correction = list(event.tokens[event.accepted_drafts :])
        # A step cut short by a stop rule inside its drafts has no correction and rejected nothing.
        rejected = list(event.drafted[event.accepted_drafts :]) if correction else []
        segments = [Segment(ACCEPTED, self._extend(accepted))]
        segments.append(Segment(REJECTED, self._continuation(rejected)))
        segments.append(Segment(CORRECTION if event.drafted else PLAIN, self._extend(correction)))
        return [segment for segment in segments if segment.text]

    def _continuation(self, tokens: list[int]) -> str:
        """Text that `tokens` would add to the output, without adding them."""
        if not tokens:
            return ""
        full = self.decode(self.tokens + tokens)
        return full[len(self.text) :] if full.startswith(self.text) else self.decode(tokens)

    def _extend(self, tokens: list[int]) -> str:
        piece = self._continuation(tokens)
        self.tokens += tokens
        self.text += piece
        return piece


def output_text(segments: Sequence[Segment]) -> str:
    """What the model actually generated: everything except the rejected drafts."""
    return "".join(segment.text for segment in segments if segment.kind != REJECTED)
