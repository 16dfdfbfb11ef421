"""tools/graph_latency.py on a tiny architecture: every graph variant exported and timed."""

import json

import pytest

from streamfuse.tools import graph_latency

pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")


def test_times_decode_and_each_trees_graph_variants(tiny_base_dir, tmp_path):
    out = tmp_path / "latency.json"
    code = graph_latency.main(
        [
            "--base-model",
            str(tiny_base_dir),
            "--gamma",
            "2",
            "--msa-layers",
            "2",
            "--trees",
            "gamma=2,k=1",
            "--schedules",
            "fused,deferred",
            "--draft-vocab",
            "40,0",
            "--capacity",
            "64",
            "--context",
            "20",
            "--reps",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = {row["graph"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "decode",
        "step, 3 nodes",
        "streams (after step, 3 nodes)",
        *(f"greedy_step, 3 nodes, {s}, draft vocab {d}" for s in ("fused", "deferred") for d in (40, 97)),
    }
    assert rows["decode"]["ratio_to_decode"] == 1.0 and all(row["median_ms"] > 0 for row in rows.values())


def test_unknown_schedule_is_named():
    with pytest.raises(SystemExit, match="--schedules takes fused, deferred, got eager"):
        graph_latency.main(["--schedules", "eager"])
