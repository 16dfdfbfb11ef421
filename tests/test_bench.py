"""tools/bench.py on a tiny checkpoint: interleaved runs, parity, report files."""

import json

from streamfuse.tools import bench


def test_bench_writes_report_with_parity_and_ratios(checkpoint, tmp_path):
    out = tmp_path / "bench"
    code = bench.main(["--artifact", str(checkpoint / "ckpt"), "--task", "dialogsum", "--input-file",
                       str(checkpoint / "data" / "dialogsum.test.jsonl"), "--limit", "3", "--warmup", "1",
                       "--max-new-tokens", "8", "--threads", "1", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    summary = report["summary"]
    assert summary["inputs"] == 3 and summary["parity_mismatches"] == 0
    calls = sum(r["ss"]["model_calls"] for r in report["rows"])
    assert abs(summary["call_reduction"] - summary["new_tokens"] / calls) < 1e-12
    assert report["machine"]["threads"] == 1 and report["machine"]["omp_wait_policy"] == "PASSIVE"
    assert "call reduction CR" in (out / "bench.md").read_text()
    for name in ("ss", "ar"):
        trace = json.loads((out / f"trace_{name}.json").read_text())
        assert len(trace["runs"]) == 3  # warm-up runs are not traced
