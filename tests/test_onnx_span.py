"""What static_graph.span_rows relies on: ONNX Runtime gives a column the same bits whatever follows it.

An ONNX call takes the cache cut to a multiple of SPAN_QUANTUM rows (or all C), so a tree call and plain
decoding of one of its nodes may see caches of different lengths. Their sums agree only if the extra
slots, masked scores and zero probabilities, change nothing before them: probed here with one-op models.
"""

import numpy as np
import pytest

from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.runtime.backends.static_graph import SPAN_QUANTUM

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
TensorProto, helper = onnx.TensorProto, onnx.helper


def one_op(op: str, inputs: list[str], **attributes):
    """An onnx.ModelProto of the one op, any shapes."""
    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in [*inputs, "y"]]
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], **attributes)], op, values[:-1], values[-1:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def session(request):
    def make(model):
        options = ort.SessionOptions()
        options.intra_op_num_threads = request.param
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return make


# used columns, then the total widths tried (quanta of SPAN_QUANTUM, and odd widths: streams' keys follow)
WIDTHS = [(1, [64, 128, 67]), (63, [64, 128, 192, 131]), (64, [64, 128, 320]), (200, [256, 320, 1088, 259]),
          (700, [704, 768, 1024, 1152, 1283])]


@pytest.mark.parametrize("used, widths", WIDTHS)
def test_softmax_of_a_column_ignores_masked_columns_after_it(session, used, widths):
    run = session(one_op("Softmax", ["x"], axis=-1)).run
    rng = np.random.default_rng(used)
    scores = (rng.standard_normal((6, used)) * 3).astype(np.float32)
    results = []
    for width in widths:
        x = (GRAPH_MASKED + rng.standard_normal((6, width))).astype(np.float32)
        x[:, :used] = scores
        results.append(run(None, {"x": x})[0][:, :used])
    assert all(np.array_equal(result, results[0]) for result in results)


@pytest.mark.parametrize("used, widths", WIDTHS)
def test_probs_times_values_ignores_zero_terms_after_the_used_slots(session, used, widths):
    """[kv, 1, rows, K] x [kv, blocks, K, 16]: the shapes of export/graph_attention.py decode_ordered."""
    run = session(one_op("MatMul", ["a", "b"])).run
    rng = np.random.default_rng(used)
    probs = rng.random((3, 1, 9, used), dtype=np.float32)
    values = rng.standard_normal((3, 4, used, 16)).astype(np.float32)
    results = []
    for width in widths:
        a, b = np.zeros((3, 1, 9, width), np.float32), rng.standard_normal((3, 4, width, 16)).astype(np.float32)
        a[..., :used], b[:, :, :used] = probs, values
        results.append(run(None, {"a": a, "b": b})[0])
    assert all(np.array_equal(result, results[0]) for result in results)


@pytest.mark.parametrize("used", [5, 63, 64, 200])
def test_scores_of_a_key_do_not_depend_on_the_keys_after_it_from_a_quantum_on(session, used):
    """rows [kv, rows, d] x keys [kv, d, K]: the same bits at every width of SPAN_QUANTUM or more (one key
    alone runs another kernel, which span_rows never asks for)."""
    run = session(one_op("MatMul", ["a", "b"])).run
    rng = np.random.default_rng(used)
    rows, keys = rng.standard_normal((3, 9, 64)).astype(np.float32), rng.standard_normal((3, 64, used))
    results = []
    for width in (SPAN_QUANTUM, 2 * SPAN_QUANTUM, 5 * SPAN_QUANTUM + 3):
        b = rng.standard_normal((3, 64, max(width, used))).astype(np.float32)
        b[..., :used] = keys
        results.append(run(None, {"a": rows, "b": b})[0][..., :used])
    assert all(np.array_equal(result, results[0]) for result in results)
