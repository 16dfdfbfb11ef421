"""streamfuse load-test (tools/load_test.py): a small run against a server it starts on the tiny model, and the
checks that make a run fail."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette", reason="the server extra (pip install 'streamfuse[server]')")
pytest.importorskip("uvicorn", reason="the server extra (pip install 'streamfuse[server]')")

from streamfuse.tools import load_test  # noqa: E402
from streamfuse.tools.load_probes import Probe, Probes, expect  # noqa: E402
from streamfuse.tools.load_test import Ask, Outcome, Report, judge  # noqa: E402


def test_a_small_run_passes_and_reports_the_server_memory(artifact, tmp_path, capsys):
    """4 clients x 3 requests against `streamfuse serve` on the tiny artifact's fastest engine, started by the tool."""
    out = tmp_path / "summary.md"
    argv = ["--artifact", str(artifact), "--clients", "4", "--requests", "3", "--max-tokens", "8"]
    assert load_test.main([*argv, "--seed", "3", "--out", str(out)]) == 0
    summary = out.read_text()
    assert summary.strip().endswith("**passed**") and "12 requests" in summary
    assert "server RSS:" in summary and "after the warm-up" in summary
    assert summary.strip() == capsys.readouterr().out.strip()
    for row in ("| 10 MB body | 413 | 413 | yes |", '| "messages": 5 | 400 | 400 | yes |', "| bad Host | 421 | 421 |"):
        assert row in summary
    assert (
        "| worker fault in one lane mid-batch | 500 for it, 200 for the others and after | 200, 500, 200, 200 |"
        in summary
    )
    assert (
        "| wrong API key | 401 | 401 | yes |" in summary and "| foreign Origin | 403, no body | 403 | yes |" in summary
    )
    assert "| client stalls reading a stream | others served, lane freed | 200, freed | yes |" in summary
    assert "10 MB body: /health answered within" in summary and "MiB after it" in summary


def test_the_plan_mixes_every_kind_and_is_reproducible():
    shares = dict.fromkeys(load_test.KINDS, 1.0)
    first = load_test.plan(16, 20, 0, shares)
    assert first == load_test.plan(16, 20, 0, shares) and len(first) == 16 and len(first[0]) == 20
    assert {ask.kind for mine in first for ask in mine} == set(load_test.KINDS)


def test_judge_catches_wrong_incomplete_and_misanswered_requests():
    truth = {(False, 0): Outcome(Ask("whole"), 200, "a b c", "length", 3)}
    assert not judge(Outcome(Ask("stream"), 200, "a b c", "length", 3), truth).problem
    assert "differs" in judge(Outcome(Ask("stream"), 200, "a b", "length", 2), truth).problem
    assert "incomplete" in judge(Outcome(Ask("whole"), 200, "a b c", None, None), truth).problem
    assert "not a 4xx" in judge(Outcome(Ask("malformed"), 200), truth).problem
    assert not judge(Outcome(Ask("malformed"), 400, "bad"), truth).problem
    assert "status 503" in judge(Outcome(Ask("whole"), 503, "busy"), truth).problem
    assert not judge(Outcome(Ask("disconnect"), 200, "a"), truth).problem  # a dropped stream is not compared


def test_memory_growth_past_the_bound_fails_the_run():
    fine = Report([Outcome(Ask("whole"), 200, "a", "stop", 1)], 1.0, rss=(100 << 20, 102 << 20))
    grown = Report(fine.outcomes, 1.0, rss=(100 << 20, 110 << 20))
    assert fine.passed and not grown.passed and "FAILED" in grown.markdown() and "+10.00%" in grown.markdown()


def test_a_probe_fails_on_a_wrong_status_a_long_message_or_a_body_where_none_belongs():
    one_line = b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}'
    assert not expect(Probe("p", "400"), (400, one_line), 400).problem
    assert "status 500" in expect(Probe("p", "400"), (500, one_line), 400).problem
    assert "several lines" in expect(Probe("p", "400"), (400, one_line.replace(b"bad", b"bad\\nworse")), 400).problem
    assert "not an OpenAI error" in expect(Probe("p", "400"), (400, b"Internal Server Error"), 400).problem
    assert "a body of" in expect(Probe("p", "403"), (403, one_line), 403, empty=True).problem


def test_a_failed_probe_or_missing_metrics_fail_the_run():
    fine = Report([Outcome(Ask("whole"), 200, "a", "stop", 1)], 1.0, probes=Probes([Probe("p", "400", "400")]))
    assert fine.passed and "| p | 400 | 400 | yes |" in fine.markdown()
    probed = Report(fine.outcomes, 1.0, probes=Probes([Probe("p", "400", "500", "status 500")], 0.5, 3 << 20))
    assert not probed.passed and "| p | 400 | 500 | no: status 500 |" in probed.markdown()
    assert "within 500 ms" in probed.markdown() and "+3.0 MiB" in probed.markdown()
    assert not Report(fine.outcomes, 1.0, metrics=["/metrics: no streamfuse_lanes_busy"]).passed
