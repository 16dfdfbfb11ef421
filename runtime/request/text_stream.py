"""Token ids in, text out as it becomes certain: the incremental detokenizer of streamed generations.

    text = Detokenizer.for_tokenizer(tokenizer, stop=("\\n\\n",))
    for step_tokens in steps:
        print(text.push(step_tokens), end="")   # whole characters only; "" while nothing is certain
    print(text.finish())                         # the rest: the streamed deltas join to final_text(...)

A generation's text is `final_text`: its tokens decoded with special tokens skipped, cut where the first stop
string starts, stripped of surrounding whitespace. A delta is streamed only when no later token can change it,
so the deltas joined equal that text exactly. What stays held back:
- a trailing U+FFFD: a byte-level token that ends inside a multi-byte character decodes to it until the
  character's other bytes come;
- a tail that could still become a stop string (the stop string's text is never streamed);
- trailing whitespace (the final text is stripped), and a tail the tokenizer's space clean-up (" ." -> ".")
  could still rewrite.
Every push decodes the whole sequence again: a tokenizer's decode of a window is not the window's share of the
whole decode (SentencePiece's leading space, clean-ups across the window's edge), and decoding a few hundred
ids is microseconds next to the model call that made them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamfuse.runtime.artifact.tokenizer import CLEANUPS

REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of an unfinished character


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` up to where its first stop string starts, and whether one was found."""
    found = [at for at in (text.find(s) for s in stop if s) if at >= 0]
    return (text[: min(found)], True) if found else (text, False)


def final_text(raw: str, stop: Sequence[str] = ()) -> str:
    """A generation's text from its decoded tokens (special tokens skipped): cut at the first stop string,
    stripped."""
    return cut_at_stop(raw, stop)[0].strip()


def held_tail(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns` (it may still grow into
    that pattern)."""
    longest = 0
    for pattern in patterns:
        for size in range(min(len(pattern) - 1, len(text)), longest, -1):
            if text.endswith(pattern[:size]):
                longest = size
                break
    return longest


def certain_prefix(raw: str, stop: Sequence[str], holds: Sequence[str] = ()) -> str:
    """The part of final_text(raw + anything that follows) that `raw` already fixes."""
    text, stopped = cut_at_stop(raw, stop)
    if stopped:
        return text.strip()
    text = text.rstrip(REPLACEMENT)  # an unfinished character: it may complete a stop string's prefix
    text = text[: len(text) - held_tail(text, (*stop, *holds))]
    return text.strip()


def cleanup_patterns(tokenizer) -> tuple[str, ...]:
    """The texts a tokenizer's decode rewrites (Transformers' clean_up_tokenization), where it cleans up spaces."""
    cleans = getattr(tokenizer, "clean_up_spaces", None)
    if cleans is None:
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    return tuple(before for before, _ in CLEANUPS) if cleans else ()


@dataclass
class Detokenizer:
    """Token ids in, text deltas out: whole characters, special tokens skipped, stop strings honoured."""

    decode: Callable[[list[int]], str]  # ids -> text with special tokens skipped
    stop: tuple[str, ...] = ()
    holds: tuple[str, ...] = ()  # texts the decoder may still rewrite once more tokens come
    ids: list[int] = field(default_factory=list)
    sent: str = ""  # what the deltas have given so far
    stopped: bool = False  # a stop string appeared: nothing after it is ever streamed

    @classmethod
    def for_tokenizer(cls, tokenizer, stop: Sequence[str] = ()) -> Detokenizer:
        """A detokenizer on a Transformers-style tokenizer (decode(ids, skip_special_tokens=True))."""
        return cls(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            tuple(s for s in stop if s),
            cleanup_patterns(tokenizer),
        )

    def push(self, ids: Sequence[int]) -> str:
        """Take a step's new tokens; return the text they make certain ("" if none)."""
        if self.stopped or not ids:
            return ""
        self.ids.extend(int(token) for token in ids)
        raw = self.decode(self.ids)
        self.stopped = cut_at_stop(raw, self.stop)[1]
        return self._advance(certain_prefix(raw, self.stop, self.holds))

    def text(self) -> str:
        """The final text of the tokens pushed so far (what the deltas join to once `finish` has run)."""
        return final_text(self.decode(self.ids), self.stop)

    def finish(self) -> str:
        """The generation ended: the rest of its final text (held-back whitespace inside it, a character that
        stayed unfinished, a stop string's prefix that never completed)."""
        return self._advance(self.text())

    def _advance(self, certain: str) -> str:
        if not certain.startswith(self.sent):  # cannot happen while decode extends its earlier text
            return ""
        delta, self.sent = certain[len(self.sent) :], certain
        return delta
