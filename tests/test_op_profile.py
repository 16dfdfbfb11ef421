"""streamfuse op-profile (tools/op_profile.py): the bucket rules as literal tables, the place of each op among the
layers, and the tool on the tiny artifact's graphs (ONNX Runtime's profiler; ExecuTorch by ETDump or perf)."""

from __future__ import annotations

import json
import shutil

import pytest

from streamfuse.cli import main as cli
from streamfuse.tools.op_profile import BUCKETS, OpTime, Shape, buckets_of, kind_of
from streamfuse.tools.op_sampling import symbol_bucket

from tiny_export import needs

# (op type, node name) as the exported ONNX graphs and ONNX Runtime's fusions name them -> kind
KINDS = [
    ("If", "decode", "method switch"),
    ("Equal", "Equal_12", "method switch"),
    ("TreeAttention", "node_tree_attention_2", "attention kernel"),
    ("CommitRows", "node_commit_rows", "cache commit"),
    ("Q4Linear", "linear_4/packed/product", "linear"),
    ("Q8Linear", "node_linear_28", "linear"),
    ("MatMulNBits", "node_linear_3", "linear"),
    ("Gemm", "node_linear_29", "linear"),
    ("MatMul", "linear_4/packed/left", "LoRA (separate nodes)"),
    ("Add", "linear_4/packed/sum", "LoRA (separate nodes)"),
    ("SkipSimplifiedLayerNormalization", "node_mul_5/rms_norm/skip", "norms"),
    ("RotaryEmbedding", "node_add_2/rotary", "RoPE"),
    ("Slice", "cos_1/half", "RoPE"),
    ("Sin", "node_sin_1", "RoPE"),
    ("QuickGelu", "node_silu/QuickGeluFusion/", "SwiGLU / activations"),
    ("TopK", "node_topk__1", "top-k / accept"),
    ("ArgMax", "node_argmax", "top-k / accept"),
    ("Greater", "node_gt_1", "masks (tree, streams)"),
    ("Gather", "node_select_2", "masks (tree, streams)"),
    ("Reshape", "node_repeat_interleave", "masks (tree, streams)"),
    ("Gather", "node_embedding", "embedding"),
    ("Concat", "node_cat_5", "copies"),
    ("Mul", "node_mul_12", "other"),
]

# a perf sample's frames, leaf first -> bucket (ExecuTorch without ETDump)
SYMBOLS = [
    (["xnn_qd8_f32_qc4w_gemm_minmax_ukernel_4x16c8__avx512vnni"], "linears: XNNPACK (all)"),
    (
        ["void executorch::runtime::FunctionRef<void (long, long)>::callback_fn<(anonymous namespace)::run_linear"],
        "linears: streamfuse op (all)",
    ),
    (
        ["[unknown]", "(anonymous namespace)::tree_attention_out(executorch::runtime::KernelRuntimeContext&)"],
        "attention kernel",
    ),
    (["torch::executor::native::topk_out"], "top-k / accept"),
    (["__memmove_avx512_unaligned_erms"], "copies / concats / other"),
    (["thread_main"], "threadpool wait, system"),
    (["executorch::runtime::Method::execute_instruction"], "runtime dispatch (ET, Python)"),
    (["[unknown]"], "other (unresolved symbols)"),
]


@pytest.mark.parametrize(("op", "name", "kind"), KINDS)
def test_rules_classify_known_nodes(op, name, kind):
    assert kind_of(op, name) == kind


@pytest.mark.parametrize(("frames", "bucket"), SYMBOLS)
def test_symbols_classify_known_kernels(frames, bucket):
    assert symbol_bucket(frames) == bucket
    assert bucket in BUCKETS


def layer(linears: list[str]) -> list[OpTime]:
    """One decoder layer as ONNX Runtime runs it: norm, q/k/v, attention, o, norm, gate/up, SwiGLU, down."""
    q, o, gate, down = linears
    return [
        OpTime("rms_norm/skip", "SkipSimplifiedLayerNormalization", 1),
        OpTime(q, "Q4Linear", 10),
        OpTime("node_tree_attention", "TreeAttention", 3),
        OpTime(o, "Q4Linear", 4),
        OpTime("rms_norm/skip", "SkipSimplifiedLayerNormalization", 1),
        OpTime(gate, "Q4Linear", 12),
        OpTime("node_mul_12", "Mul", 1),
        OpTime(down, "Q4Linear", 6),
    ]


def test_ops_are_placed_among_the_layers():
    """4 layers, the top 2 the stream layers: the stream inputs between them, the LM head then the draft head."""
    names = ["linear/packed/product", "node_linear_3", "linear_4/packed/product", "node_linear_6"]
    stream_inputs = [OpTime("node_gather", "GatherElements", 2), OpTime("node_matmul_f_eta", "MatMul", 5)]
    heads = [
        OpTime("final/rms_norm/skip", "SkipSimplifiedLayerNormalization", 1),
        OpTime("node_linear_28", "Q8Linear", 20, width=49152),
        OpTime("node_matmul", "MatMul", 1, width=4),  # the accept rule's product over the tree's rows
        OpTime("node_argmax", "ArgMax", 1),
        OpTime("node_linear_29", "Q8Linear", 9, width=16384),
        OpTime("node_topk", "TopK", 2),
    ]
    ops = layer(names) + layer(names) + stream_inputs + layer(names) + layer(names) + heads
    buckets = buckets_of(ops, Shape(4, 2, "greedy_step_4"))
    placed = dict(zip((id(op) for op in ops), buckets))
    assert [placed[id(op)] for op in ops[:8]].count("linears: main layers") == 4
    assert [placed[id(op)] for op in ops[18:26]].count("linears: stream layers") == 4
    assert [placed[id(op)] for op in stream_inputs] == ["f_eta / stream inputs"] * 2
    assert placed[id(ops[6])] == "SwiGLU / activations"
    assert [placed[id(op)] for op in heads] == [
        "norms",
        "LM head",
        "top-k / accept",
        "top-k / accept",
        "draft head",
        "top-k / accept",
    ]
    # decode: no stream rows, so the same ops between the layers are the layers' own
    plain = buckets_of(layer(names) * 4 + heads[:2], Shape(4, 2, "decode"))
    assert plain.count("linears: main layers") == 8 and plain.count("linears: stream layers") == 8
    assert plain[-1] == "LM head"


def run_tool(capsys, artifact, tmp_path, backend: str) -> dict:
    out = tmp_path / f"{backend}.json"
    argv = ["op-profile", "--artifact", str(artifact), "--backends", backend, "--spans", "20", "--rounds", "2"]
    assert cli([*argv, "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "unexplained" in printed and "greedy_step_15-decode" in printed
    return json.loads(out.read_text())["ms"][backend]["20"]


def check_sums(tables: dict) -> None:
    assert set(tables) == {"prefill", "decode", "step_15", "greedy_step_15", "streams"}
    for graph, table in tables.items():
        assert sum(table[name] for name in BUCKETS) == pytest.approx(table["profiled"], abs=1e-9), graph
        assert table["profiled"] >= 0 and table["wall"] > 0  # perf may catch no sample of a tiny call
        assert table["unexplained"] == pytest.approx(table["wall"] - table["profiled"])


@needs("onnxruntime")
def test_the_tool_names_every_op_of_the_onnx_graphs(artifact, tmp_path, capsys):
    tables = run_tool(capsys, artifact, tmp_path, "onnxruntime")
    check_sums(tables)
    assert all(table["profiled"] > 0 for table in tables.values())
    decode, greedy = tables["decode"], tables["greedy_step_15"]
    assert decode["attention kernel"] > 0 and decode["linears: main layers"] > 0 and decode["LM head"] > 0
    assert decode["f_eta / stream inputs"] == 0 and decode["draft head"] == 0
    # a chunk's rows through the same linears, no draft work (the tiny model's linears cost about what
    # one row's do: their time is the call's, so no ratio is asserted)
    prefill = tables["prefill"]
    assert prefill["linears: main layers"] > 0 and prefill["draft head"] == 0
    assert greedy["draft head"] > 0 and greedy["top-k / accept"] > 0 and greedy["f_eta / stream inputs"] > 0


@needs("executorch")
@pytest.mark.skipif(shutil.which("perf") is None, reason="ExecuTorch's pip runtime has no ETDump; perf samples it")
def test_the_tool_profiles_executorch(artifact, tmp_path, capsys):
    check_sums(run_tool(capsys, artifact, tmp_path, "executorch"))


def test_a_bad_artifact_is_one_line(tmp_path, capsys):
    assert cli(["op-profile", "--artifact", str(tmp_path / "missing")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("streamfuse op-profile: error:") and "\n" not in err
