"""Metrics shared by the tasks, all returned in percent (0-100)."""

from __future__ import annotations

import re
from collections.abc import Sequence

# One ROUGE recipe for the build and the benchmark (tools/quality.py): RougeScorer with the
# stemmer, best reference per example, rougeLsum over regex-split sentences (nltk is offline).
from streamfuse.tools.quality import ROUGE_KEYS, split_sentences  # noqa: F401  (re-exported for the tasks)
from streamfuse.tools.quality import rouge as _best_reference_rouge


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
    return _best_reference_rouge(predictions, references)


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
