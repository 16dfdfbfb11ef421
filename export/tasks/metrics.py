"""Metrics shared by the tasks, all returned in percent (0-100)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from rouge_score import rouge_scorer

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")

# rougeLsum scores the union LCS over *sentences*, which rouge_score reads as
# "\n"-separated lines. Its own splitter needs nltk's punkt data, which is not
# available offline, so a small regex splitter is used instead.
_SENTENCE_END = re.compile(r"""[.!?]+["')\]]*\s+""")
# A period after these does not end a sentence ("Mr. Smith", "e.g. this").
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no"})


def split_sentences(text: str) -> list[str]:
    """Sentences of *text*: existing line breaks, then ./!/? followed by space."""
    sentences = []
    for line in text.splitlines():
        start = 0
        for match in _SENTENCE_END.finditer(line):
            candidate = line[start : match.end()].strip()
            if candidate.split()[-1].rstrip(".").lower() in _ABBREVIATIONS:
                continue
            sentences.append(candidate)
            start = match.end()
        tail = line[start:].strip()
        if tail:
            sentences.append(tail)
    return sentences


@lru_cache(maxsize=1)
def _scorer() -> rouge_scorer.RougeScorer:
    # Building the scorer loads the Porter stemmer; do it once per process.
    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def _check_lengths(predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} reference tuples")
    if not predictions:
        raise ValueError("nothing to score: no predictions")
    if any(not refs for refs in references):
        raise ValueError("every example needs at least one reference")


def rouge(predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F1 x100, best reference per example and metric, averaged."""
    _check_lengths(predictions, references)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for prediction, refs in zip(predictions, references):
        targets = ["\n".join(split_sentences(ref)) for ref in refs]
        # score_multi keeps, per metric, the reference with the highest F1.
        scores = _scorer().score_multi(targets, "\n".join(split_sentences(prediction)))
        for key in ROUGE_KEYS:
            totals[key] += scores[key].fmeasure
    return {key: 100.0 * total / len(predictions) for key, total in totals.items()}


def normalize_sql(query: str) -> str:
    """Case-, whitespace- and trailing-';'-insensitive form of a SQL query."""
    query = re.sub(r"[\s;]+$", "", query.strip())
    return " ".join(query.split()).lower()


def exact_match(predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
    """Percent of predictions equal (after :func:`normalize_sql`) to any reference."""
    _check_lengths(predictions, references)
    hits = sum(
        normalize_sql(prediction) in {normalize_sql(ref) for ref in refs}
        for prediction, refs in zip(predictions, references)
    )
    return {"exact_match": 100.0 * hits / len(predictions)}
