"""training/report.py's acceptance bars as a literal table: which bars a run's figures give, and their verdicts."""

import pytest

from streamfuse.training.report import bars

BASELINE = "SS rougeLsum >= LoRA baseline - 1.0"
ZERO_SHOT = "SS rougeLsum >= zero-shot + 5.0"
STREAM_1 = "stream-1 top-1 accuracy on own answers >= 50%"

# SS Lsum, LoRA baseline Lsum, zero-shot Lsum, stream 1 top-1 on the references, on own answers -> (bar, pass)
BARS = [
    (38.90, 39.24, 22.69, 40.3, 55.7, [(BASELINE, True), (ZERO_SHOT, True), (STREAM_1, True)]),
    (37.00, 39.24, None, 60.0, 45.0, [(BASELINE, False), (STREAM_1, False)]),  # the references do not count
    (39.38, None, None, 39.0, 50.0, [(STREAM_1, True)]),  # the limit itself passes
    (39.38, None, 35.00, 39.0, None, [(ZERO_SHOT, False)]),  # no own-answer accuracy: no stream bar
]


def summary(ss, baseline, zero_shot, references, own) -> dict:
    quality = {"ss": {"rougeLsum": ss}}
    quality.update({k: {"rougeLsum": v} for k, v in (("lora_baseline", baseline), ("zero_shot", zero_shot)) if v})
    return {
        "quality": quality,
        "headline_metrics": ["rougeLsum"],
        "stream_accuracy": {"stream_1": {"top1": references}},
        "stream_accuracy_own": {} if own is None else {"stream_1": {"top1": own}},
    }


@pytest.mark.parametrize("ss, baseline, zero_shot, references, own, expected", BARS)
def test_bars(ss, baseline, zero_shot, references, own, expected):
    checks = bars(summary(ss, baseline, zero_shot, references, own))
    assert [(c["bar"], c["pass"]) for c in checks] == expected
    stream = [c for c in checks if c["bar"] == STREAM_1]
    assert [c["value"] for c in stream] == ([own] if own is not None else [])
