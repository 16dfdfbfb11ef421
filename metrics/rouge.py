"""ROUGE F1 (x100) against every reference of a task row: the build's evaluation and the benchmark.

rouge_score's RougeScorer with the Porter stemmer, the best reference per example and metric, and
rougeLsum over sentences split by a small regex (rouge_score's own splitter needs nltk data, which
is not available offline).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_SENTENCE_END = re.compile(r"""[.!?]+["')\]]*\s+""")
# A period after these does not end a sentence ("Mr. Smith", "e.g. this").
_ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no"})


def split_sentences(text: str) -> list[str]:
    """Sentences of *text*: existing line breaks, then ./!/? followed by white space."""
    sentences = []
    for line in text.splitlines():
        start = 0
        for match in _SENTENCE_END.finditer(line):
            candidate = line[start : match.end()].strip()
            if candidate.split()[-1].rstrip(".").lower() in _ABBREVIATIONS:
                continue
            sentences.append(candidate)
            start = match.end()
        if tail := line[start:].strip():
            sentences.append(tail)
    return sentences


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer  # lazy: scoring is the last thing a run does

    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean over examples of the best-reference F1 x100 per ROUGE key."""
    check_lengths(predictions, references)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for prediction, refs in zip(predictions, references):
        targets = ["\n".join(split_sentences(ref)) for ref in refs]
        scores = _scorer().score_multi(targets, "\n".join(split_sentences(prediction)))
        for key in ROUGE_KEYS:
            totals[key] += scores[key].fmeasure
    return {key: 100.0 * total / len(predictions) for key, total in totals.items()}


def check_lengths(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} reference tuples")
    if not predictions:
        raise ValueError("nothing to score: no predictions")
    if any(not refs for refs in references):
        raise ValueError("every example needs at least one reference")
