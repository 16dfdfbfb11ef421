"""Corpus BLEU (x100) against every reference of a task row, as the E2E NLG challenge reports it:
sacrebleu's corpus BLEU (13a tokenisation, case-sensitive, exponential smoothing off) with each MR's
references as parallel streams; an MR with fewer references leaves the later streams empty (None),
which sacrebleu skips for that segment."""

from __future__ import annotations

from collections.abc import Sequence


def bleu(predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
    """{"bleu": corpus BLEU in percent} of *predictions* against their reference tuples."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference sets")
    if not predictions:
        return {"bleu": 0.0}
    import sacrebleu  # lazy: scoring is the last thing a run does

    streams = max(len(refs) for refs in references)
    columns = [[refs[i] if i < len(refs) else None for refs in references] for i in range(streams)]
    return {"bleu": sacrebleu.corpus_bleu(list(predictions), columns).score}
