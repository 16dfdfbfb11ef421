"""export/onnx_methods.py: every method in one ONNX model, and what that does to memory."""

import subprocess
import sys

import numpy as np
import pytest

from streamfuse.export.onnx_methods import combine_methods, method_graph, strip_debug_info
from streamfuse.export.to_onnx import share_weights
from streamfuse.runtime.artifact.contract import METHOD_INPUT, METHODS, method_output

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
TensorProto, helper, numpy_helper = onnx.TensorProto, onnx.helper, onnx.numpy_helper

K, N, LAYERS = 576, 1536, 40  # SmolLM2's MLP shape: 21 MiB of 4-bit weights, large beside the runtime's own RSS


def weights() -> list:
    rng = np.random.default_rng(0)
    tensors = []
    for layer in range(LAYERS):
        codes = rng.integers(0, 256, size=(N, K // 32, 16), dtype=np.uint8)
        scales = (rng.random(N * K // 32, dtype=np.float32) * 0.01 + 0.001).astype(np.float32)
        tensors += [numpy_helper.from_array(codes, f"codes{layer}"), numpy_helper.from_array(scales, f"scales{layer}")]
    return tensors + [
        numpy_helper.from_array(np.array([value], np.int64), name)
        for name, value in (("start", 0), ("end", K), ("axis", 1))
    ]


def method_model(method: str, extra: float) -> "onnx.ModelProto":
    """x [M, K] -> LAYERS MatMulNBits over the shared 4-bit weights (each output cut back to K), + `extra`:
    each method its own graph over the same weights."""
    nodes, x = [], "x"
    for layer in range(LAYERS):
        nodes += [
            helper.make_node(
                "MatMulNBits",
                [x, f"codes{layer}", f"scales{layer}"],
                [f"y{layer}"],
                domain="com.microsoft",
                K=K,
                N=N,
                bits=4,
                block_size=32,
                accuracy_level=4,
            ),
            helper.make_node("Slice", [f"y{layer}", "start", "end", "axis"], [f"x{layer}"]),
        ]
        x = f"x{layer}"
    nodes += [
        helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.FLOAT, [], [extra])),
        helper.make_node("Add", [x, "c"], ["out"], name="add"),
    ]
    nodes[0].metadata_props.add(key="stack", value="a long trace " * 50)
    graph = helper.make_graph(
        nodes,
        method,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["M", K])],
        initializer=weights(),
        value_info=[helper.make_tensor_value_info("y0", TensorProto.FLOAT, ["M", N])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The five methods as separate models and combined, weights in a file beside each."""
    folder = tmp_path_factory.mktemp("methods")
    separate = {m: method_model(m, float(i)) for i, m in enumerate(METHODS)}
    for method, model in separate.items():
        (folder / method).mkdir()
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        share_weights(copy, folder / method / "weights.bin")
        onnx.save_model(copy, str(folder / method / "model.onnx"))
    for model in separate.values():
        strip_debug_info(model)
    combined = combine_methods(separate)
    share_weights(combined, folder / "weights.bin")
    onnx.save_model(combined, str(folder / "model.onnx"))
    return folder, combined


def test_each_method_is_its_branch_and_gives_what_its_own_model_gives(models):
    folder, combined = models
    assert [n.name for n in combined.graph.node if n.op_type == "If"] == list(METHODS)
    assert len(combined.graph.initializer) == 2 * LAYERS + 3  # the same weights in five graphs: once
    assert not method_graph(combined, "decode").value_info
    assert not [n for n in method_graph(combined, "decode").node if n.metadata_props]
    with pytest.raises(KeyError, match="no method 'medusa'"):
        method_graph(combined, "medusa")
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((3, K), dtype=np.float32)
    unpacked = ort.SessionOptions()
    unpacked.add_session_config_entry("session.disable_prepacking", "1")
    (raw,) = ort.InferenceSession(str(folder / "decode" / "model.onnx"), unpacked).run(None, {"x": x})
    for index, method in enumerate(METHODS):
        own = ort.InferenceSession(str(folder / method / "model.onnx"), providers=["CPUExecutionProvider"])
        (want,) = own.run(None, {"x": x})
        (got,) = session.run([method_output(method, "out")], {METHOD_INPUT: np.array(index, np.int64), "x": x})
        assert np.array_equal(got, want), method
        assert not np.array_equal(got, raw + index - 1)  # unpacked weights give other bits: each branch is prepacked
        others = session.run(None, {METHOD_INPUT: np.array(index, np.int64), "x": x})
        assert [o.size for o in others] == [want.size if m == method else 0 for m in METHODS]


LOAD_RSS = """
import sys, onnxruntime as ort
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
options = ort.SessionOptions()
options.intra_op_num_threads = 1
before = rss()
sessions = [ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]) for path in sys.argv[1:]]
print(rss() - before)
"""


def load_rss(paths) -> int:
    """RSS one process adds opening these models (a fresh process: no freed memory to reuse)."""
    result = subprocess.run(
        [sys.executable, "-c", LOAD_RSS, *map(str, paths)], capture_output=True, text=True, check=True
    )
    return int(result.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")
def test_one_session_holds_the_weights_once_for_all_methods(models):
    """Five sessions (one per method graph) hold five prepacked copies of the weights; in one model the
    four further methods cost a fraction of that (measured: 0.2 of it, about the weight bytes once)."""
    folder, _ = models
    weight_bytes = (folder / "weights.bin").stat().st_size
    one = load_rss([folder / "decode" / "model.onnx"])
    combined = load_rss([folder / "model.onnx"])
    separate = load_rss([folder / m / "model.onnx" for m in METHODS])
    assert separate - one >= 3 * weight_bytes, (separate, one, weight_bytes)  # the test sees copies
    assert combined - one <= 0.3 * (separate - one), (combined, one, separate, weight_bytes)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads mappings from /proc")
def test_the_weights_pages_onnx_runtime_keeps_mapped_go_back_to_the_kernel(models):
    """MatMulNBits packs its scales but keeps the mapped originals, resident since packing read them; the host
    releases those clean pages (OnnxRuntimeRunner does after loading) and the session computes the same bits."""
    from streamfuse.runtime.backends.runners import mappings, release_file_pages

    def resident_in(folder) -> int:
        return sum(mapping.resident_kb for mapping in mappings(folder)) * 1024

    folder, _ = models
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((3, K), dtype=np.float32)
    feed = {METHOD_INPUT: np.array(1, np.int64), "x": x}
    (before,) = session.run([method_output("decode", "out")], feed)
    scales = LAYERS * N * K // 32 * 4
    assert resident_in(folder) >= scales  # the test sees the kept scales
    assert release_file_pages(folder) >= scales
    assert resident_in(folder) < scales // 4
    (after,) = session.run([method_output("decode", "out")], feed)
    assert np.array_equal(after, before)
