"""SQL exact match, in percent: case-, whitespace- and trailing-';'-insensitive."""

from __future__ import annotations

import re
from collections.abc import Sequence

from streamfuse.metrics.rouge import check_lengths


def normalize_sql(query: str) -> str:
    """Case-, whitespace- and trailing-';'-insensitive form of a SQL query."""
    query = re.sub(r"[\s;]+$", "", query.strip())
    return " ".join(query.split()).lower()


def exact_match(predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
    """Percent of predictions equal (after :func:`normalize_sql`) to any reference."""
    check_lengths(predictions, references)
    hits = sum(
        normalize_sql(prediction) in {normalize_sql(ref) for ref in refs}
        for prediction, refs in zip(predictions, references)
    )
    return {"exact_match": 100.0 * hits / len(predictions)}
