"""Low-bit ONNX artifacts on a tiny model converted from a Q4_1 GGUF: q4-native keeps the GGUF's
codes bit for bit, int8 quantizes the merged weights, and both stay lossless against their own
plain decoding (greedy and seeded sampling)."""

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, quants

from streamfuse.export.artifact import ArtifactBuilder, ExportConfig
from streamfuse.export.onnx_methods import method_graph
from streamfuse.runtime.artifact.format import Artifact
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig

from conftest import write_checkpoint
from tiny_export import DRAFT, build, build_beside, prompts

pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")

FORMATS = ("q4-native", "int8")


def config(fmt: str, backend: str = "onnxruntime") -> ExportConfig:
    # the default 4-node chain (streams beside every node): a chain step's rows are exactly plain decoding's
    return ExportConfig(
        backends=(backend,),
        trees=("gamma=3,k=1",),
        buckets=(4,),
        capacity=128,
        prefill_chunk=16,
        quantize=fmt,
        parity_prompts=4,
        greedy_schedule="fused",
    )


@pytest.fixture(scope="module")
def gguf_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gguf"), gguf=True)


@pytest.fixture(scope="module")
def artifacts(gguf_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("low-bit")
    return {
        fmt: ArtifactBuilder(gguf_checkpoint / "ckpt", out / fmt, config(fmt), prompts(4), 24, {}, DRAFT).build()
        and out / fmt
        for fmt in FORMATS
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_manifest_records_the_format_and_its_parity(artifacts, fmt):
    manifest = Artifact.open(artifacts[fmt]).manifest
    assert manifest["graphs"]["quantize"] == {"onnxruntime": fmt}
    details = manifest["graphs"]["formats"]["onnxruntime"]
    assert details["name"] == fmt and "int8 per row" in details["activations"]
    assert details["lora"] == ("float32, unmerged" if fmt == "q4-native" else "merged")
    parity = manifest["parity"]["onnxruntime"]
    assert parity["ss_equals_own_plain"] == parity["plain_prompts"] == 4
    assert parity["within_tolerance"] is None and parity["max_abs_diff"]["step_4.logits"] > 0  # error vs fp32, recorded


@pytest.mark.parametrize("fmt", FORMATS)
def test_low_bit_ss_equals_its_own_plain_decoding_greedy_and_sampled(artifacts, fmt):
    loaded = load(artifacts[fmt], "onnxruntime")
    assert_lossless(loaded, prompts(6, seed=5) + [ids * 2 for ids in prompts(2, seed=6)], StopRules(30))


def assert_lossless(loaded, prompt_list, rules: StopRules) -> None:
    """SS equals the backend's own plain decoding on every prompt, greedy and sampled (one seed each)."""
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    for seed, ids in enumerate(prompt_list):
        for settings in (
            DecodeSettings("ss", rules, tree=loaded.tree),
            DecodeSettings("ss", rules, tree=loaded.tree, sampling=sampling, seed=seed),
        ):
            plain = generate(loaded.backend, ids, settings).token_ids
            assert generate(loaded.backend, ids, settings).token_ids == plain


def test_onnx_graphs_keep_the_whole_cache_in_place_through_streamfuses_ops(artifacts):
    """Each graph takes the host's [L, kv, C, d] cache as one input each for keys and values and touches it only
    through streamfuse's ops: one CommitRows (the previous call's accepted rows moved into place), then one
    TreeAttention per layer and pass (the layer an attribute), each starting at CommitRows' output, so ONNX
    Runtime, which orders ops by data only, runs the move first. No op copies or slices the cache."""
    import onnx

    from streamfuse.runtime.ops.tree_attention import ONNX_COMMIT_OP, ONNX_DOMAIN, ONNX_OP

    model = onnx.load(str(artifacts["int8"] / "onnx" / "model.onnx"), load_external_data=False)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs["keys"] == inputs["values"] and inputs["keys"][2] == 128, inputs["keys"]  # all C rows
    layers = inputs["keys"][0]
    for method in ("prefill", "decode", "step_4", "greedy_step_4"):
        graph = method_graph(model, method)
        readers = [n for n in graph.node if {"keys", "values"} & set(n.input)]
        assert all(n.domain == ONNX_DOMAIN for n in readers), method
        (commit,) = [n for n in readers if n.op_type == ONNX_COMMIT_OP]
        attentions = [n for n in readers if n.op_type == ONNX_OP]
        assert len(attentions) == len(readers) - 1 and all(n.input[3] == commit.output[0] for n in attentions)
        attended = sorted(a.i for n in attentions for a in n.attribute if a.name == "layer")
        assert set(attended) == set(range(layers)), (method, attended)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_norm_of_every_method_runs_one_kernel_and_projections_are_packed(artifacts, fmt):
    """A row's norm is the same arithmetic in every method (ONNX Runtime's two norm kernels round differently,
    and a tree step's stream layers concatenate rows before the norms that decode feeds from the residual Add):
    no SimplifiedLayerNormalization is left; each layer's q / k / v and gate / up are one product each (in q4-native
    one streamfuse.Q4Linear with the LoRA inside, no MatMul left), the head one streamfuse.Q8Linear in q4-native."""
    import onnx

    from streamfuse.runtime.artifact.contract import method_names

    model = onnx.load(str(artifacts[fmt] / "onnx" / "model.onnx"), load_external_data=False)
    for method in method_names((4,)):
        ops = [n.op_type for n in method_graph(model, method).node]
        assert "SimplifiedLayerNormalization" not in ops and "SkipSimplifiedLayerNormalization" in ops, method
        if method in ("prefill", "decode", "step_4") and fmt == "int8":
            assert ops.count("Split") == 2 * 4 and ops.count("MatMulNBits") == 4 * 4 + 1, (method, fmt)
        if method in ("prefill", "decode", "step_4") and fmt == "q4-native":  # one node a (packed) linear, the head
            assert ops.count("Split") == 2 * 4 and ops.count("Q4Linear") == 4 * 4, (method, fmt)
            assert ops.count("Q8Linear") == 1 and "MatMulNBits" not in ops and "MatMul" not in ops, method


LAYOUT_OPS = (
    "Reshape",
    "Transpose",
    "Cast",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Expand",
    "Slice",
    "Concat",
    "Identity",
)


def test_no_method_folds_a_copy_of_a_weight(artifacts):
    """ONNX Runtime constant-folds a layout op on an initializer into a new tensor, in each method's
    branch: a Reshape of the LM head's scales would be a 3.5 MB copy per method on SmolLM2."""
    import onnx

    from streamfuse.runtime.artifact.contract import method_names

    for fmt in ("q4-native", "int8"):
        model = onnx.load(str(artifacts[fmt] / "onnx" / "model.onnx"), load_external_data=False)
        stored = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
        for method in method_names((4,)):
            folded = [
                (n.op_type, n.input[0])
                for n in method_graph(model, method).node
                if n.op_type in LAYOUT_OPS and n.input and n.input[0] in stored
            ]
            assert not folded, (fmt, method, folded)


def test_q4_native_weights_are_the_gguf_codes_bit_for_bit(artifacts, gguf_checkpoint):
    """Every streamfuse.Q4Linear of the exported decode graph holds exactly the GGUF's Q4_1 blocks (codes, fp16
    scales and minimums: gguf's own dequantization gives the same weights; q / k / v and gate / up packed, their
    rows one after another), and every layer is there once."""
    import onnx
    from onnx import numpy_helper

    from streamfuse.runtime.ops import q4_linear

    model = onnx.load(str(artifacts["q4-native"] / "onnx" / "model.onnx"), load_external_data=True)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    exported = []
    for node in method_graph(model, "decode").node:
        if node.op_type == q4_linear.ONNX_OP:
            width = next(a.i for a in node.attribute if a.name == "out_features")
            codes, scales, mins = q4_linear.unpack(values[node.input[1]], width)
            blocks = codes.reshape(width, -1, 32).astype(np.float32)
            exported.append((blocks * scales[..., None] + mins[..., None]).reshape(width, -1))
    reader = GGUFReader(gguf_checkpoint / "base" / "model.gguf")
    layers = [t for t in reader.tensors if t.name.startswith("blk.")]
    assert len(layers) == 4 * 7 and len(exported) == 4 * 4  # per layer: q / k / v, o, gate / up, down
    assert sum(len(matrix) for matrix in exported) == sum(int(t.shape[1]) for t in layers)
    for tensor in layers:
        weight = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType.Q4_1)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:  # the GGUF keeps llama.cpp's row order
            heads = 4 if ".attn_q." in tensor.name else 2
            weight = weight.reshape(heads, -1, 2, weight.shape[1]).swapaxes(2, 1).reshape(weight.shape)
        rows = len(weight)
        assert any(
            np.array_equal(matrix[start : start + rows], weight.astype(np.float32))
            for matrix in exported
            for start in range(0, len(matrix) - rows + 1, rows)
        ), tensor.name


def test_backends_without_the_format_export_unquantized_and_say_so(gguf_checkpoint, tmp_path):
    builder = ArtifactBuilder(gguf_checkpoint / "ckpt", tmp_path / "a", ExportConfig(quantize="q4-native"), [], 8, {})
    assert [builder.format(b) for b in ("onnxruntime", "executorch", "coreml")] == ["q4-native", "q4-native", "none"]
    with pytest.raises(ValueError, match=r"export.quantize \(--quantize\) must be one of none, int8, 8da4w, q4-native"):
        ExportConfig(quantize="q3").validate()


@pytest.fixture(scope="module")
def q4_executorch(tmp_path_factory):
    """The q4-native ExecuTorch artifact on each linear -> (manifest, folder), lowered at once: XNNPACK's form
    here, streamfuse's op beside it."""
    pytest.importorskip("executorch", reason="the executorch extra is not installed")
    root = tmp_path_factory.mktemp("q4-executorch")
    shallow = write_checkpoint(root / "shallow", layers=2, msa_layers=1, gguf=True)  # lowering time grows with depth

    def on(linear: str) -> ExportConfig:  # the module's chain, on ExecuTorch
        return replace(config("q4-native", "executorch"), parity_prompts=3, pte_linear=linear)

    beside = build_beside(shallow / "ckpt", root / "streamfuse", on("streamfuse"), prompts(3), 24)
    here = build(shallow / "ckpt", root / "xnnpack", on("xnnpack"), prompts(3), 24)
    return {"xnnpack": (here, root / "xnnpack"), "streamfuse": (beside.result(), root / "streamfuse")}


@pytest.mark.parametrize("linear", ["xnnpack", "streamfuse"])
def test_q4_native_on_executorch_records_its_weight_error_and_stays_lossless(q4_executorch, linear):
    """XNNPACK's closest form (bf16 scales, per-channel int8 head), or streamfuse's own op with the file's exact
    weights: the manifest says what it is and how far its weights are from the GGUF's; SS == its own plain
    decoding, greedy and sampled."""
    manifest, out = q4_executorch[linear]
    details = manifest["graphs"]["formats"]["executorch"]
    own = linear == "streamfuse"
    assert details["name"] == "q4-native" and details["lora"] == "float32, unmerged"
    assert ("streamfuse's own op" if own else "bf16") in details["linear"]
    errors = details["max_weight_error"]
    if own:  # the file's weights exactly
        assert errors == {"linear": 0, "lm_head": 0} and "q8_0" in details["lm_head"]
    else:
        assert 0 <= errors["linear"] < 1e-2 and 0 < errors["lm_head"] < 1e-2
    assert manifest["parity"]["executorch"]["ss_equals_own_plain"] == 3
    loaded = load(out, "executorch")
    assert_lossless(loaded, prompts(4, seed=7), StopRules(24))


def test_q4_native_needs_the_base_models_gguf(checkpoint, tmp_path):
    """The shared tiny checkpoint's base folder has no GGUF: a clear error before anything exports."""
    builder = ArtifactBuilder(checkpoint / "ckpt", tmp_path / "a", config("q4-native"), prompts(1), 8, {})
    with pytest.raises(FileNotFoundError, match="has no .gguf file"):
        builder.build()
    assert not (tmp_path / "a").exists()


def test_bench_runs_several_artifacts_in_one_interleaved_run(artifacts, gguf_checkpoint, tmp_path):
    """BACKEND@FOLDER rows: each artifact's ONNX Runtime against its own plain decoding, labelled
    with its format, memory measured once its graphs are open."""
    import json

    from streamfuse.tools import bench

    from conftest import write_tiny_dialogsum

    data = write_tiny_dialogsum(tmp_path / "data")
    entries = [f"onnxruntime@{artifacts[fmt]}" for fmt in FORMATS]
    code = bench.main(
        [
            "--artifact",
            str(artifacts["q4-native"]),
            "--task",
            "dialogsum",
            "--input-file",
            str(data / "dialogsum.test.jsonl"),
            "--limit",
            "2",
            "--warmup",
            "0",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--backends",
            ",".join(entries),
            "--out",
            str(tmp_path / "bench"),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    rows = {r["name"]: r for r in report["table"]}
    assert set(rows) == {f"{m}/{e}" for e in entries for m in ("ar", "ss")}
    assert [rows[f"ss/{e}"]["precision"] for e in entries] == list(FORMATS)
    assert all(rows[f"ss/{e}"]["load_rss_bytes"] > 0 for e in entries)
    assert report["summary"]["parity_mismatches"] == 0
    assert (tmp_path / "bench" / f"trace_ss_{entries[1].replace('@', '-').replace('/', '_')}.json").is_file()
