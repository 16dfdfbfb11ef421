"""tools/latency.py on a tiny architecture: a plain step and each tree's step timed, in every dtype."""

import json

import pytest

from streamfuse.tools import latency


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_times_plain_and_tree_steps(tiny_base_dir, tmp_path, dtype):
    out = tmp_path / "latency.json"
    code = latency.main(
        [
            "--base-model",
            str(tiny_base_dir),
            "--gamma",
            "2",
            "--msa-layers",
            "2",
            "--trees",
            'gamma=2,k=1;{"paths": [[0], [1], [1, 0]], "lookup": [1, 0]}',
            "--context",
            "12",
            "--reps",
            "2",
            "--threads",
            "1",
            "--dtype",
            dtype,
            "--kernels",
            "eager",
            "--out",
            str(out),
            *(["--lossless", "3", "--lossless-tokens", "40"] if dtype == "float32" else []),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    rows = {row["config"]: row for row in report["rows"]}
    assert report["meta"]["dtype"] == dtype
    assert list(rows)[0] == "plain" and rows["plain"]["ratio_to_plain"] == 1.0
    assert len(rows) == 3 and all(row["median_ms"] > 0 for row in rows.values())
    if dtype != "float32":  # a timing mode: the runtime's torch backend runs fp32 (bf16 rows differ by row count)
        return
    checked = report["meta"]["lossless"]  # SS against plain decoding on random prompts, per tree
    assert list(checked) == list(rows)[1:] and all(row["same"] == row["runs"] == 3 for row in checked.values())
    assert max(row["tokens_per_step"] for row in checked.values()) > 1  # drafts accepted: rows beyond the root decided
