"""tools/bench.py on a tiny checkpoint: interleaved runs, parity, backends, peers, ROUGE, report files."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from streamfuse.metrics import rouge
from streamfuse.runtime.artifact.prompt import PromptFormat
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.tools import bench, bench_data


def test_bench_writes_report_with_parity_and_ratios(checkpoint, tmp_path):
    out = tmp_path / "bench"
    code = bench.main(
        [
            "--artifact",
            str(checkpoint / "ckpt"),
            "--task",
            "dialogsum",
            "--input-file",
            str(checkpoint / "data" / "dialogsum.test.jsonl"),
            "--limit",
            "3",
            "--warmup",
            "1",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
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


# argv after the tiny checkpoint -> exit status, the one line on stderr
BENCH_PROBES = [
    (["--task", "e2e_nlg", "--input-file", "TEST"], 2, "fine-tuned for 'dialogsum'"),
    (["--task", "dialogsum", "--input-file", "nowhere.jsonl"], 1, "nowhere.jsonl"),
    (["--task", "dialogsum", "--split", "test", "--max-new-tokens", "0"], 2, "max_new_tokens must be > 0"),
]


@pytest.mark.parametrize("argv, status, message", BENCH_PROBES, ids=[p[2] for p in BENCH_PROBES])
def test_bench_bad_input_is_one_line(checkpoint, tmp_path, capsys, argv, status, message):
    from streamfuse.runtime.commands import errors

    argv = [
        "--artifact",
        str(checkpoint / "ckpt"),
        "--data-dir",
        str(checkpoint / "data"),
        "--out",
        str(tmp_path),
        *[str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv],
    ]
    argv = [str(checkpoint / "data" / "dialogsum.test.jsonl") if a == "TEST" else a for a in argv]
    assert errors.run(bench.main, argv, prog="bench") == status
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\n")[-1].split("\r")[-1]
    assert last.startswith("bench: error: ") and message in last and "Traceback" not in err, err


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(checkpoint, out, *extra):
    return bench.main(
        [
            "--artifact",
            str(checkpoint / "ckpt"),
            "--task",
            "dialogsum",
            "--limit",
            "2",
            "--warmup",
            "1",
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_split_methods_and_peers_give_the_table(checkpoint, tmp_path, monkeypatch):
    real = importlib.util.find_spec  # llama-cpp-python "not installed": its peer is skipped, not fatal
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    out = tmp_path / "bench"
    code = run_bench(
        checkpoint,
        out,
        "--split",
        "test",
        "--data-dir",
        str(checkpoint / "data"),
        "--methods",
        "ar,ss",
        "--peers",
        "hf,llamacpp_f32",
    )
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {r["name"]: r for r in report["table"]}
    assert list(rows) == ["ar/torch", "ss/torch", "hf"]
    assert report["settings"]["data"].endswith("dialogsum.test.jsonl")
    assert report["summary"]["parity_mismatches"] == 0 and report["summary"]["peer_mismatches"] == {"hf": 0}
    assert "llama-cpp-python" in report["skipped"]["llamacpp_f32"]
    ar, ss, hf = rows["ar/torch"], rows["ss/torch"], rows["hf"]
    assert ar["call_reduction"] == ar["mean_accepted_tokens"] == ar["speedup_total_time"] == 1.0
    assert ar["speedup_after_first_token"] == 1.0 and ss["speedup_after_first_token"] > 0
    calls = sum(r["ss"]["model_calls"] for r in report["rows"])
    assert ss["call_reduction"] == ss["new_tokens"] / calls and ss["mean_accepted_tokens"] >= 1.0
    assert ss["mismatches"] == 0 and ss["baseline"] == "ar/torch" and hf["baseline"] == "ar/torch"
    assert hf["call_reduction"] is None and hf["precision"] == "fp32" and hf["model"] == "fine-tuned"
    for row in rows.values():
        assert row["inputs"] == 2 and row["tokens_per_s_median"] > 0 and 0 < row["ttft_s_median"] < 10
        runs = [
            r[row["method"]] if row["kind"] == "streamfuse" else r["results"][row["name"]]
            for r in (report["rows"] if row["kind"] == "streamfuse" else report["peer_rows"])
        ]
        after = sum(r["new_tokens"] - 1 for r in runs) / sum(r["seconds"] - r["ttft_s"] for r in runs)
        assert row["decode_tokens_per_s"] == pytest.approx(after)  # prompt time left out
        assert row["prompt_ms_per_token_median"] > 0
        assert set(row["rouge"]) >= {"rouge1", "rougeLsum"} and 0 <= row["rouge"]["rouge1"] <= 100
    assert rows["ar/torch"]["rouge"] == rows["ss/torch"]["rouge"] == rows["hf"]["rouge"]  # the same outputs
    machine = report["machine"]
    assert machine["omp_wait_policy"] == "PASSIVE" and {"torch", "transformers"} <= set(machine["versions"])
    assert len(machine["load_average_start"]) == len(machine["load_average_end"]) == 3
    for png in ("tokens_per_s.png", "speedup.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    text = (out / "bench.md").read_text()
    assert "| ss/torch | fp32 |" in text and "Skipped peer llamacpp_f32" in text
    assert "| tokens/s after the first token | prompt ms per token (median) |" in text
    assert not list(out.glob(".*.tmp"))  # atomic writes leave nothing behind


@pytest.fixture(scope="module")
def onnx_artifact(checkpoint, tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    from streamfuse.export.artifact import ArtifactBuilder, ExportConfig

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (12, 20)]
    out = tmp_path_factory.mktemp("bench-export") / "artifact"
    config = ExportConfig(backends=("torch", "onnxruntime"), capacity=128, prefill_chunk=16, parity_prompts=2)
    ArtifactBuilder(checkpoint / "ckpt", out, config, prompts, 16, {}).build()
    return out


def test_backends_each_against_their_own_ar(checkpoint, onnx_artifact, tmp_path):
    out = tmp_path / "bench"
    code = bench.main(
        [
            "--artifact",
            str(onnx_artifact),
            "--task",
            "dialogsum",
            "--input-file",
            str(checkpoint / "data" / "dialogsum.test.jsonl"),
            "--limit",
            "2",
            "--warmup",
            "1",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--backends",
            "torch,onnxruntime",
            "--repeats",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert [r["name"] for r in report["table"]] == ["ar/torch", "ss/torch", "ar/onnxruntime", "ss/onnxruntime"]
    assert [(r["id"], r["backend"]) for r in report["rows"]] == [
        ("test_0", "torch"),
        ("test_0", "onnxruntime"),
        ("test_1", "torch"),
        ("test_1", "onnxruntime"),
    ]
    assert all(r["same_tokens"] and len(r["ss"]["seconds_repeats"]) == 2 for r in report["rows"])
    onnx = {r["name"]: r for r in report["table"]}["ss/onnxruntime"]
    assert onnx["baseline"] == "ar/onnxruntime" and onnx["precision"] == "fp32" and onnx["speedup_total_time"] > 0
    assert report["summary"]["parity_mismatches"] == 0 and report["summary"]["primary_backend"] == "torch"
    for name in ("trace_ss.json", "trace_ar.json", "trace_ss_onnxruntime.json", "trace_ar_onnxruntime.json"):
        assert len(json.loads((out / name).read_text())["runs"]) == 2
    assert json.loads((out / "trace_ss_onnxruntime.json").read_text())["meta"]["backend"].startswith("onnxruntime")


def test_task_files_and_e2e_csv_grouping(checkpoint, tmp_path, monkeypatch):
    assert bench_data.SHARED_DATA_ROOT == Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data
    monkeypatch.setattr(bench_data, "SHARED_DATA_ROOT", tmp_path / "nowhere")
    monkeypatch.setenv("STREAMFUSE_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="dialogsum.test.jsonl not found"):
        bench_data.task_file("dialogsum", "test")
    assert (
        bench_data.task_file("dialogsum", "test", checkpoint / "data") == checkpoint / "data" / "dialogsum.test.jsonl"
    )
    with pytest.raises(FileNotFoundError, match="known: dialogsum/train"):
        bench_data.task_file("sqlcontext", "test")
    (tmp_path / "e2e_nlg").mkdir()
    (tmp_path / "e2e_nlg" / "testset_w_refs.csv").write_text(
        'mr,ref\n"name[A], food[B]",A serves B.\nother,Other.\n"name[A], food[B]",B at A.\n'
    )
    path = bench_data.task_file("e2e_nlg", "test")
    inputs = bench_data.read_inputs(path, PromptFormat("{source}", "{mr}", 64), None)
    assert inputs == [
        bench_data.BenchInput("e2e-test-0", "name[A], food[B]", ("A serves B.", "B at A.")),
        bench_data.BenchInput("e2e-test-1", "other", ("Other.",)),
    ]


def test_rouge_takes_the_best_reference_and_splits_sentences():
    assert rouge.split_sentences("Mr. Smith came. He left!  Then") == ["Mr. Smith came.", "He left!", "Then"]
    scores = rouge.rouge(["the cat sat"], [("a dog ran", "the cat sat")])
    assert scores["rouge1"] == scores["rougeLsum"] == 100.0
    with pytest.raises(ValueError, match="every example needs at least one reference"):
        rouge.rouge(["x"], [()])


def test_interleaved_and_summarise_keep_the_profile_stage_shape(checkpoint):
    from dataclasses import replace

    from streamfuse.runtime.measure.timing import interleaved, summarise
    from streamfuse.runtime.request.emitter import StopRules
    from streamfuse.runtime.request.frontend import DEFAULT_TREE
    from streamfuse.runtime.request.inputs import Input
    from streamfuse.runtime.request.loader import load
    from streamfuse.runtime.request.trace import Trace
    from streamfuse.runtime.speculation.tree import TreeSpec

    loaded = load(checkpoint / "ckpt")
    ss = DecodeSettings("ss", StopRules(6, loaded.stop_token_ids), tree=TreeSpec.parse(DEFAULT_TREE))
    traces = {"ss": Trace(method="ss"), "ar": Trace(method="ar")}
    requests = [Input(str(i), "a b c") for i in range(3)]
    rows = interleaved(loaded, requests, ss, replace(ss, method="ar"), traces, warmup=1)
    assert [r["id"] for r in rows] == ["1", "2"] and all(r["same_tokens"] for r in rows)
    assert len(traces["ss"].runs) == len(traces["ar"].runs) == 2
    summary = summarise(rows)
    assert summary["inputs"] == 2 and summary["parity_mismatches"] == 0 and summary["ar_ttft_s_median"] > 0


def test_artifact_and_backends_default_to_the_build_output(onnx_artifact, checkpoint, tmp_path, monkeypatch):
    """`python tools/bench.py --task dialogsum --split test` benchmarks artifacts/<task> on every
    backend it was built for that runs here (torch from its adapter, plus the exported engines), the
    fastest first (uncalibrated: the CPU preference order)."""
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "dialogsum").symlink_to(onnx_artifact)
    monkeypatch.chdir(tmp_path)
    args = bench.parse_args(["--task", "dialogsum", "--split", "test"])
    assert args.artifact == Path("artifacts/dialogsum") and args.backends == ["onnxruntime", "torch"]
    assert bench.parse_args(
        ["--task", "dialogsum", "--split", "test", "--artifact", str(checkpoint / "ckpt")]
    ).backends == ["torch"]


def test_speed_up_after_the_first_token_leaves_prompt_time_out():
    from streamfuse.tools.bench_summary import _speedups

    fast = [{"new_tokens": 11, "seconds": 3.0, "ttft_s": 1.0, "token_ids": [1]}]
    slow = [{"new_tokens": 11, "seconds": 5.0, "ttft_s": 1.0, "token_ids": [1]}]
    found = _speedups(fast, slow)
    assert found["speedup_total_time"] == pytest.approx(5 / 3)  # 11/3 vs 11/5 tokens/s
    assert found["speedup_after_first_token"] == pytest.approx(2.0)  # 10 tokens in 2 s vs in 4 s


def test_speed_up_per_fifth_of_the_inputs_is_each_fifths_time_ratio():
    from streamfuse.tools.bench_summary import _speedups

    def runs(seconds):
        return [{"new_tokens": 10, "seconds": s, "ttft_s": 0.5, "token_ids": [1]} for s in seconds]

    # ten inputs: fifths of two; SS is twice as fast on the first fifth only
    ss = runs([1, 1] + [2] * 8)
    ar = runs([2, 2] + [2] * 8)
    found = _speedups(ss, ar)
    assert found["speedup_by_fifth"] == pytest.approx([2.0, 1.0, 1.0, 1.0, 1.0])
    assert _speedups(ss[:4], ar[:4])["speedup_by_fifth"] is None  # fewer than five inputs


def _row(kind, name, precision, tokens_per_s, method="ss", model="fine-tuned"):
    return {
        "kind": kind,
        "name": name,
        "method": method,
        "precision": precision,
        "model": model,
        "tokens_per_s_median": tokens_per_s,
        "decode_tokens_per_s": 2 * tokens_per_s,
    }


def test_peers_are_matched_by_bits_per_weight_not_by_layout():
    from streamfuse.tools.bench_summary import matched_precision

    rows = [
        _row("streamfuse", "ss/executorch", "q4-native", 40.0),
        _row("streamfuse", "ss/onnxruntime", "q4-native", 30.0),
        _row("streamfuse", "ar/executorch", "q4-native", 35.0, method="ar"),
        _row("peer", "llamacpp_q4_1_lora", "q4_1", 20.0),
        _row("peer", "llamacpp_base_q4_1", "q4_1", 60.0, model="base"),
        _row("peer", "optimum_executorch_8da4w", "8da4w", 25.0),
        _row("peer", "llamacpp_q8_0", "q8_0", 30.0),
    ]
    assert matched_precision(rows) == [
        {
            "precision": "4-bit",
            "streamfuse": "ss/executorch",
            "peer": "optimum_executorch_8da4w",
            "streamfuse_tokens_per_s": 40.0,
            "peer_tokens_per_s": 25.0,
            "ratio": 1.6,
            "decode_ratio": 1.6,
        }
    ]
