"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
last n-gram (n = max_ngram down to 1). Summaries, answers and code copy from their input, so
these drafts are often right where the streams are not; a tree's lookup branch carries them
(runtime/speculation/tree.py). Lossless like every draft: the target model still verifies each token.

The index maps each n-gram to the position right after its latest occurrence that already has
a following token, updated as tokens arrive, so drafting costs O(max_ngram) per step.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_NGRAM = 3


class PromptLookup:
    def __init__(self, tokens: Iterable[int] = (), max_ngram: int = MAX_NGRAM):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it follows every n-gram ending at end - 1
            for n in range(1, min(self.max_ngram, end) + 1):
                self.after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(token))

    def draft(self, length: int) -> list[int]:
        """Up to `length` tokens continuing the longest suffix n-gram seen before; [] if none."""
        for n in range(min(self.max_ngram, len(self.tokens)), 0, -1):
            start = self.after.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + length]
        return []
