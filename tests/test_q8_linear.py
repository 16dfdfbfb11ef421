"""The Q8_0 head op (runtime/ops/q8_linear.py, runtime/kernels/q8_linear.h): layout, the kernel against its NumPy
reference bit for bit on every path, rows and threads, the embedding's gather index, and its errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.runtime.ops import q4_linear, q8_linear

# Blocks whose activations quantize exactly (max |x| = 127: xd = 1, q = x): y = d · Σ q_w x.
#   codes (one column, 32 inputs), d, x                      -> y
LITERAL = [
    ([1] * 32, 0.5, [127, -1] + [0] * 30, 63.0),
    ([-128] * 32, 1.0, [127] + [0] * 31, -16256.0),  # the extreme code: no saturation on any path
    ([127] * 32, 2.0, [-127] * 32, 2.0 * 127 * -127 * 32),
    ([-128, 127] * 16, 0.25, [127, 127] + [0] * 30, 0.25 * (-128 + 127) * 127),
]


def layer(rng, n: int, k: int):
    codes = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scales = rng.uniform(1e-4, 0.01, (n, k // 32)).astype(np.float16).astype(np.float32)
    return (codes, scales), q8_linear.pack(codes, scales)


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512_vnni"])
@pytest.mark.parametrize("codes, d, x, y", LITERAL)
def test_literal_table(path, codes, d, x, y):
    if path not in q4_linear.available_paths():
        pytest.skip(f"this CPU does not run the {path} path")
    packed = q8_linear.pack(np.asarray([codes], np.int8), np.asarray([[d]], np.float32))
    assert q8_linear.linear(np.asarray([x], np.float32), *packed, 1, path=path).tolist() == [[y]]
    assert q8_linear.reference(np.asarray([x], np.float32), *packed, 1).tolist() == [[y]]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 70),
    blocks=st.integers(1, 5),
    rows=st.integers(1, 64),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_kernel_is_the_reference_bit_for_bit_on_every_path(n, blocks, rows, threads, seed):
    rng = np.random.default_rng(seed)
    (codes, scales), packed = layer(rng, n, 32 * blocks)
    x = (rng.standard_normal((rows, 32 * blocks)) * rng.uniform(0.1, 10)).astype(np.float32)
    x[0, :3] = 0
    expected = q8_linear.reference(x, *packed, n)
    for path in q4_linear.available_paths():
        got = q8_linear.linear(x, *packed, n, path=path, threads=threads)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), path
    back = q8_linear.unpack(*packed, n, 32 * blocks)
    assert np.array_equal(back[0], codes) and np.array_equal(back[1], scales)


def test_a_rows_bits_do_not_depend_on_the_call():
    rng = np.random.default_rng(0)
    _, packed = layer(rng, 1000, 576)
    x = rng.standard_normal((16, 576)).astype(np.float32)
    alone = np.concatenate([q8_linear.linear(x[r : r + 1], *packed, 1000) for r in range(16)])
    for rows in (2, 4, 5, 16):
        for threads in (1, 2):
            got = q8_linear.linear(x[:rows], *packed, 1000, threads=threads)
            assert np.array_equal(got.view(np.uint32), alone[:rows].view(np.uint32)), (rows, threads)


def test_close_to_the_exact_product():
    rng = np.random.default_rng(1)
    (codes, scales), packed = layer(rng, 300, 576)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    dense = (codes.reshape(300, -1, 32) * scales[..., None].astype(np.float64)).reshape(300, 576)
    exact = x.astype(np.float64) @ dense.T
    assert np.abs(q8_linear.linear(x, *packed, 300) - exact).max() < 0.02 * np.abs(exact).max()


def test_the_embedding_gathers_its_rows_from_the_heads_codes():
    rng = np.random.default_rng(2)
    (codes, scales), (flat_codes, flat_scales) = layer(rng, 37, 96)
    code_base, code_offset, scale_base, scale_offset = q8_linear.embedding_index(37, 96)
    ids = np.array([0, 36, 17, 17, 5])
    assert np.array_equal(flat_codes[code_base[ids][:, None] + code_offset], codes[ids])
    assert np.array_equal(flat_scales[scale_base[ids][:, None] + scale_offset], scales[ids])


def test_bad_calls_are_one_line_errors():
    rng = np.random.default_rng(3)
    _, (codes, scales) = layer(rng, 20, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for call, message in [
        (lambda: q8_linear.linear(x, codes[:-1], scales, 20), "codes must hold"),
        (lambda: q8_linear.linear(x, codes, scales[:-1], 20), "codes must hold"),
        (lambda: q8_linear.linear(x[:, :40], codes, scales, 20), "in_features must be"),
        (lambda: q8_linear.linear(x, codes, scales, 20, path="sve"), "path one of"),
    ]:
        with pytest.raises(q4_linear.Q4LinearError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("threads", [1, 2])
def test_onnx_runtime_op_is_the_reference(threads):
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from streamfuse.tools import q4_bench

    rng = np.random.default_rng(4)
    _, (codes, scales) = layer(rng, 100, 64)
    inits = [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scales, "scales")]
    node = helper.make_node(q8_linear.ONNX_OP, ["x", "codes", "scales"], ["y"], domain="streamfuse", out_features=100)
    graph = helper.make_graph(
        [node],
        "q8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "M", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "M", 100])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("streamfuse", 1)], ir_version=10
    )
    session = q4_bench.onnx_session(model.SerializeToString(), threads)
    for rows in (1, 3, 16):
        x = rng.standard_normal((1, rows, 64)).astype(np.float32)
        assert np.array_equal(session.run(None, {"x": x})[0][0], q8_linear.reference(x[0], codes, scales, 100))
