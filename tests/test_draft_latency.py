"""tools/draft_latency.py on a tiny architecture: a draft model's decode call by head size on every engine here."""

import json

import pytest

from streamfuse.tools import draft_latency


def test_times_a_draft_call_per_engine_and_head_size(tiny_base_dir, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    engines = ["torch", "onnxruntime"]
    try:
        import executorch.runtime  # noqa: F401

        engines.append("executorch")
    except ImportError:
        pass  # the ExecuTorch rows are left out where the executorch extra is not installed
    out = tmp_path / "draft.json"
    assert (
        draft_latency.main(
            [
                "--base-model",
                str(tiny_base_dir),
                "--layers",
                "2",
                "--head-vocab",
                "0,40",
                "--engines",
                ",".join(engines),
                "--capacity",
                "80",
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
        == 0
    )
    rows = {(row["engine"], row["head_vocab"]): row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(engine, size) for engine in engines for size in (97, 40)}
    assert all(rows[engine, 97]["ratio_to_full_head"] == 1.0 for engine in engines)
    assert all(row["median_ms"] > 0 for row in rows.values())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engines", "tflite"], "--engines takes torch, executorch, onnxruntime"),
        (["--head-vocab", "8k"], "--head-vocab takes comma-separated whole numbers"),
        (["--context", "900"], "leaves no slot in --capacity 772"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        draft_latency.main(argv)
    assert message in capsys.readouterr().err
