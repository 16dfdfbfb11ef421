"""runtime/measure/trace_profile.py and its CLI, tools/profiler.py, on hand-made traces whose metrics are worked out by
hand below (no model)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.commands import errors
from streamfuse.runtime.measure.trace_profile import PLOTS, profile_files, profile_trace
from streamfuse.runtime.request.trace import SCHEMA
from streamfuse.tools.profiler import main

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step(nodes: int, kept: int, depth: int, lookup: int = 0, draft_calls: int = 0) -> dict:
    return {
        "tree_nodes": nodes,
        "kept_nodes": kept,
        "accepted_depth": depth,
        "tokens": depth + 1,
        "lookup_accepted": lookup,
        "draft_calls": draft_calls,
        "draft_seconds": 0.0,
    }


def run(
    run_id: str,
    calls: int,
    tokens: int,
    seconds: float,
    steps: list[dict],
    peak: int | None = None,
    plain: int = 0,
    switches: tuple[str, ...] = (),
    method: str = "ss",
    draft_calls: int = 0,
    **spans: float,
) -> dict:
    return {
        "id": run_id,
        "method": method,
        "prompt_tokens": 5,
        "new_tokens": tokens,
        "model_calls": calls,
        "draft_calls": draft_calls,
        "seconds": seconds,
        "stop_reason": "eos",
        "peak_memory_bytes": peak,
        "plain_calls": plain,
        "spans": {"prefill": 0.0, "draft": 0.0, "forward": 0.0, "accept": 0.0, "cache": 0.0, "host": 0.0, **spans},
        "steps": steps,
        "switches": [{"at_token": 1, "to": to, "tokens_per_step": None} for to in switches],
    }


def trace(method: str, runs: list[dict], tree_depth: int | None = None) -> dict:
    tree = {"paths": [], "num_nodes": 0, "depth": tree_depth, "hash": "x"} if tree_depth else None
    return {
        "schema": SCHEMA,
        "runs": runs,
        "meta": {"backend": "test", "device": "cpu", "method": method, "num_streams": 4, "tree": tree},
    }


def ss_trace() -> dict:
    """Two runs, 4 verify steps with accepted depths 2, 3 | 0, 1 on a depth-4 tree.

    Each run: 1 prefill + 2 verify calls = 3 calls; tokens 1 (prefill) + sum(depth + 1):
    run a: 1 + 3 + 4 = 8, run b: 1 + 1 + 2 = 4.
    """
    return trace(
        "ss",
        [
            run(
                "a",
                3,
                8,
                2.0,
                [step(4, 3, 2), step(5, 4, 3)],
                peak=1000,
                prefill=0.5,
                forward=1.0,
                accept=0.2,
                cache=0.1,
            ),
            run(
                "b",
                3,
                4,
                2.0,
                [step(4, 2, 0), step(4, 3, 1)],
                peak=None,
                prefill=0.5,
                forward=1.0,
                accept=0.3,
                cache=0.2,
            ),
        ],
        tree_depth=4,
    )


def ar_trace() -> dict:
    """Plain decoding: n tokens in n calls (prefill gives the first), n - 1 plain calls, no drafted steps."""
    return trace(
        "ar",
        [
            run("a", 8, 8, 6.0, [], plain=7, method="ar", prefill=1.0, forward=4.4),
            run("c", 5, 5, 3.0, [], plain=4, method="ar", prefill=1.0, forward=2.0),
        ],
    )


def test_call_reduction_and_throughput():
    metrics = profile_trace(ss_trace())
    assert (metrics["runs"], metrics["model_calls"], metrics["new_tokens"]) == (2, 6, 12)
    assert metrics["seconds"] == 4.0
    assert metrics["call_reduction"] == 2.0  # 12 tokens / 6 calls
    assert metrics["tokens_per_s"] == 3.0
    assert metrics["peak_memory_bytes"] == 1000  # run b's null is skipped


def test_plain_decoding_has_cr_one_and_no_depths():
    metrics = profile_trace(ar_trace())
    assert metrics["call_reduction"] == 1.0
    assert metrics["steps"] == 0
    assert metrics["mean_tokens_per_step"] is None and metrics["tree_utilisation"] is None
    assert metrics["acceptance_per_depth"] == [] and metrics["tokens_per_call_histogram"] == {}
    assert metrics["peak_memory_bytes"] is None
    # verify calls: the plain calls, 7 + 4
    assert metrics["forward_latency_s"] == pytest.approx(6.4 / 11)


def test_a_draft_models_calls_and_time_are_counted_beside_the_targets():
    """SD: 2 steps of a 3-token chain cost 3 draft calls each, plus the drafter's prefill: 7 in all."""
    steps = [step(4, 4, 3, draft_calls=3), step(4, 4, 0, draft_calls=3)]
    metrics = profile_trace(trace("sd", [run("a", 3, 6, 1.0, steps, method="sd", draft_calls=7, draft=0.3)], 3))
    assert (metrics["model_calls"], metrics["draft_calls"]) == (3, 7)
    assert metrics["call_reduction"] == 2.0  # target calls only
    assert metrics["draft_latency_s"] == pytest.approx(0.15)


def test_acceptance_per_depth_and_stream():
    metrics = profile_trace(ss_trace())
    assert metrics["mean_tokens_per_step"] == 2.5  # (3 + 4 + 1 + 2) / 4
    assert metrics["mean_accepted_depth"] == 1.5
    rows = metrics["acceptance_per_depth"]
    assert [r["depth"] for r in rows] == [r["stream"] for r in rows] == [1, 2, 3, 4]  # depth 4 from meta.tree
    assert [r["steps_reaching"] for r in rows] == [3, 2, 1, 0]
    assert [r["acceptance"] for r in rows] == [0.75, 0.5, 0.25, 0.0]
    assert [r["conditional_acceptance"] for r in rows] == pytest.approx([3 / 4, 2 / 3, 1 / 2, 0.0])
    assert metrics["tokens_per_call_histogram"] == {"1": 1, "2": 1, "3": 1, "4": 1}


def test_utilisation_and_pruning():
    metrics = profile_trace(ss_trace())
    # accepted path nodes (depth + 1): 3, 4, 1, 2 = 10 over tree nodes 4, 5, 4, 4 = 17
    assert metrics["tree_utilisation"] == pytest.approx(10 / 17)
    assert metrics["mean_step_utilisation"] == pytest.approx((3 / 4 + 4 / 5 + 1 / 4 + 2 / 4) / 4)
    # pruned: 1, 1, 2, 1
    assert metrics["mean_pruned_nodes"] == 1.25
    assert metrics["pruned_fraction"] == pytest.approx(5 / 17)


def test_time_split():
    metrics = profile_trace(ss_trace())
    split = metrics["time_split"]
    assert split["total_seconds"] == 4.0
    seconds = {name: s["seconds"] for name, s in split["spans"].items()}
    fractions = {name: s["fraction"] for name, s in split["spans"].items()}
    assert seconds == pytest.approx(
        {
            "prefill": 1.0,
            "draft": 0.0,
            "forward": 2.0,
            "streams": 0.0,
            "accept": 0.5,
            "cache": 0.3,
            "host": 0.0,
            "other": 0.2,
        }
    )
    assert fractions == pytest.approx(
        {
            "prefill": 0.25,
            "draft": 0.0,
            "forward": 0.5,
            "streams": 0.0,
            "accept": 0.125,
            "cache": 0.075,
            "host": 0.0,
            "other": 0.05,
        }
    )
    assert metrics["forward_latency_s"] == 0.5  # 2.0 s over 4 verify steps
    assert metrics["prefill_per_run_s"] == 0.5


def test_streams_latency_is_the_streams_span_per_verify_call():
    trace = ss_trace()
    for run in trace["runs"]:
        run["spans"]["streams"] = 0.4  # deferred stream passes, over 4 verify steps in all
    assert profile_trace(trace)["streams_latency_s"] == pytest.approx(0.4 * len(trace["runs"]) / 4)


def test_baseline_matches_only_shared_run_ids():
    base = profile_trace(ss_trace(), ar_trace())["baseline"]
    # shared id: "a" only (b is not in the baseline, c not in the trace)
    assert (base["matched_runs"], base["runs"], base["baseline_runs"]) == (1, 2, 2)
    assert (base["model_calls"], base["baseline_model_calls"]) == (3, 8)
    assert base["measured_call_ratio"] == pytest.approx(8 / 3)
    assert base["speedup"] == 3.0  # 6.0 s / 2.0 s
    assert profile_trace(ss_trace())["baseline"] is None


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_cli_writes_report(tmp_path, capsys):
    trace_path = write(tmp_path / "ss.json", ss_trace())
    base_path = write(tmp_path / "ar.json", ar_trace())
    out = tmp_path / "report"
    assert main([str(trace_path), "--baseline", str(base_path), "--out", str(out)]) == 0
    assert "CR 2" in capsys.readouterr().out
    metrics = json.loads((out / "profile.json").read_text())
    assert metrics["call_reduction"] == 2.0 and metrics["baseline"]["speedup"] == 3.0
    markdown = (out / "profile.md").read_text()
    assert "call_reduction" in markdown and "1 run ids matched" in markdown
    for name in PLOTS.values():
        assert f"({name})" in markdown
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    assert not list(out.glob("*.tmp"))


def test_script_mode_on_ar_trace(tmp_path):
    """Run as a file (tools/ first on sys.path); AR traces plot 'no data' panels."""
    trace_path = write(tmp_path / "ar.json", ar_trace())
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "profiler.py"), str(trace_path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert all((tmp_path / "out" / name).read_bytes()[:8] == PNG_MAGIC for name in PLOTS.values())


def test_wrong_schema_names_the_file(tmp_path, capsys):
    bad = write(tmp_path / "old_trace.json", {"schema": "streamfuse.trace/0", "runs": []})
    with pytest.raises(ValueError, match="old_trace.json"):
        profile_files(bad)
    assert errors.run(main, [str(bad), "--out", str(tmp_path / "out")], prog="streamfuse profile") == 2
    err = capsys.readouterr().err
    assert err.startswith("streamfuse profile: error: ") and "old_trace.json" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_lookup_share_counts_accepted_drafts_from_the_lookup_branch():
    assert profile_trace(ss_trace())["lookup_share"] == 0.0  # no tree with a lookup branch
    steps = [step(7, 7, 3, lookup=3), step(7, 7, 1), step(7, 7, 0)]
    metrics = profile_trace(trace("ss", [run("a", 4, 7, 1.0, steps)]))
    assert metrics["lookup_share"] == pytest.approx(3 / 4)


def test_a_spawned_process_reports_its_own_peak_memory_not_its_parents():
    """The build profiles in a spawned process so that the peak it reports is the runtime's; with
    ru_maxrss the child would inherit the parent's resident pages as its peak."""
    ballast = torch.ones(128 * 2**20)  # 512 MiB of float32, touched: resident until deleted below
    parent = process_peak_rss_bytes()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        child = pool.submit(process_peak_rss_bytes).result()
    del ballast
    assert parent > 512 * 2**20
    assert 0 < child < parent - 256 * 2**20


def test_a_fallbacks_plain_calls_count_in_cr_and_latency_but_not_in_acceptance():
    """Run a: 1 prefill + 2 verify steps (depths 1, 0: 3 tokens) + 3 plain calls (3 tokens) = 6 calls, 7 tokens;
    it switched to plain once and back once, then to plain again."""
    metrics = profile_trace(
        trace(
            "ss",
            [
                run(
                    "a",
                    6,
                    7,
                    3.0,
                    [step(4, 4, 1), step(4, 4, 0)],
                    plain=3,
                    switches=("plain", "ss", "plain"),
                    prefill=0.5,
                    forward=2.5,
                )
            ],
            3,
        )
    )
    assert metrics["call_reduction"] == pytest.approx(7 / 6)
    assert metrics["plain_calls"] == 3 and (metrics["switches_to_plain"], metrics["switches_to_ss"]) == (2, 1)
    assert metrics["mean_tokens_per_step"] == pytest.approx(1.5)  # speculative steps only
    assert metrics["forward_latency_s"] == pytest.approx(2.5 / 5)  # 2 steps + 3 plain calls
