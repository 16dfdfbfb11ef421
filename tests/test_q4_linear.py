"""The 4-bit linear op (runtime/ops/q4_linear.py, runtime/kernels/q4_linear.h): the layout, the kernel against its
NumPy reference bit for bit on every instruction-set path, rows, threads, LoRA and segments (siblings packed in one
node, each with its own rank), and its errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.runtime.ops import q4_linear as q4

# Blocks whose activations quantize exactly (max |x| = 127, so xd = 1 and q = x): y = d·Σ q_w x + m·Σ x.
#   codes (one column, 32 inputs), d, m, x (32 values)                                   -> y
LITERAL = [
    ([2] * 32, 0.5, -1.0, [127, -1] + [0] * 30, 0.0),  # 0.5·(2·126) - 126
    ([15] * 32, 1.0, 0.0, [127] + [0] * 31, 1905.0),  # 15·127
    (list(range(16)) * 2, 0.25, 0.5, [127] * 32, 0.25 * 127 * 240 + 0.5 * 127 * 32),
    ([0] * 31 + [15], 2.0, -0.5, [0] * 31 + [-127], 2.0 * 15 * -127 + -0.5 * -127),
]


def packed(codes, scales, mins):
    return q4.pack(np.asarray(codes, np.uint8), np.asarray(scales, np.float32), np.asarray(mins, np.float32))


def no_lora(n: int, k: int):
    return q4.pack_lora(None, None, 0.0, n, k)


@pytest.mark.parametrize("path", ["portable", "avx2", "avx512_vnni"])
@pytest.mark.parametrize("codes, d, m, x, y", LITERAL)
def test_literal_table(path, codes, d, m, x, y):
    if path not in q4.available_paths():
        pytest.skip(f"this CPU does not run the {path} path")
    weights = packed([codes], [[d]], [[m]])
    out = q4.linear(np.asarray([x], np.float32), weights, *no_lora(1, 32), 1, path=path)
    assert out.tolist() == [[y]]
    assert q4.reference(np.asarray([x], np.float32), weights, *no_lora(1, 32), 1).tolist() == [[y]]


def test_layout_is_the_files_bytes():
    """A tile-block holds 16 columns x 32 codes in 256 bytes, then 16 fp16 scales and 16 fp16 minimums."""
    codes = np.zeros((16, 32), np.uint8)
    codes[3, 5] = 7  # group 1 (inputs 4..7), i = 1: byte 64·1 + 4·3 + 1, low nibble
    codes[3, 21] = 9  # group 5: the same byte's high nibble
    scales, mins = np.full((16, 1), 0.5, np.float32), np.full((16, 1), -2.0, np.float32)
    tile = q4.pack(codes, scales, mins)[0, 0]
    assert tile.shape == (q4.TILE_BYTES,) and q4.TILE_BYTES == 16 * 20  # Q4_1: 20 bytes a block
    assert tile[64 + 12 + 1] == 7 | (9 << 4) and np.count_nonzero(tile[:256]) == 1
    assert tile[256:288].view(np.float16).tolist() == [0.5] * 16
    assert tile[288:320].view(np.float16).tolist() == [-2.0] * 16


def random_layer(rng, n: int, k: int, rank: int):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (n, k // 32)).astype(np.float16).astype(np.float32)
    mins = -scales * rng.uniform(4, 12, scales.shape).astype(np.float16).astype(np.float32)
    mins = mins.astype(np.float16).astype(np.float32)
    lora = (
        no_lora(n, k)
        if rank == 0
        else q4.pack_lora(
            rng.standard_normal((rank, k)).astype(np.float32) * 0.05,
            rng.standard_normal((n, rank)).astype(np.float32) * 0.05,
            2.0,
            n,
            k,
        )
    )
    return (codes, scales, mins), q4.pack(codes, scales, mins), lora


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 70),
    blocks=st.integers(1, 5),
    rows=st.integers(1, 64),
    rank=st.sampled_from([0, 1, 8]),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_round_trip(n, blocks, rows, rank, seed):
    (codes, scales, mins), weights, _ = random_layer(np.random.default_rng(seed), n, 32 * blocks, rank)
    back = q4.unpack(weights, n)
    assert np.array_equal(back[0], codes) and np.array_equal(back[1], scales) and np.array_equal(back[2], mins)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 70),
    blocks=st.integers(1, 5),
    rows=st.integers(1, 64),
    rank=st.sampled_from([0, 3, 16]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_kernel_is_the_reference_bit_for_bit_on_every_path(n, blocks, rows, rank, threads, seed):
    rng = np.random.default_rng(seed)
    _, weights, lora = random_layer(rng, n, 32 * blocks, rank)
    x = (rng.standard_normal((rows, 32 * blocks)) * rng.uniform(0.1, 10)).astype(np.float32)
    x[0, : min(32 * blocks, 5)] = 0  # a block with zeros; a whole zero block below
    if blocks > 1:
        x[-1, :32] = 0
    expected = q4.reference(x, weights, *lora, n)
    for path in q4.available_paths():
        got = q4.linear(x, weights, *lora, n, path=path, threads=threads)
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), path


SPECIALS = np.array([np.nan, np.inf, -np.inf, -0.0, 3e38, 1e-40, 0.0], np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit, a NaN matching any NaN (its payload is the hardware's)."""
    return bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.integers(1, 6),
    rows=st.integers(1, 13),
    rank=st.sampled_from([1, 7, 9, 17, 31, 33, 48, 95, 100]),
    specials=st.integers(0, 6),
    seed=st.integers(0, 2**31),
)
def test_every_path_is_the_portable_loops_on_any_input(blocks, rows, rank, specials, seed):
    """The vector paths' row preparation (runtime/kernels/q4_prepare.h: quantizing in 4-row blocks, x · A over
    masked column groups and tails) keeps the portable bits, on NaN, infinities, subnormals and zero blocks
    too, where the NumPy reference (which propagates a NaN through max |x|) is not the oracle."""
    rng = np.random.default_rng(seed)
    _, weights, lora = random_layer(rng, 40, 32 * blocks, rank)
    x = (rng.standard_normal((rows, 32 * blocks)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    x.flat[rng.integers(0, x.size, specials)] = rng.choice(SPECIALS, specials)
    x[rows // 2, :32] = 0
    expected = q4.linear(x, weights, *lora, 40, path="portable")
    for path in q4.available_paths():
        assert same_bits(q4.linear(x, weights, *lora, 40, path=path, threads=2), expected), path


def siblings(rng, widths: list[int], ranks: list[int], k: int):
    """Layers on one input as one node (export/onnx_pack.py): (weights stacked, LoRA joined, each layer's own)."""
    layers = [random_layer(rng, n, k, r) for n, r in zip(widths, ranks)]
    weights = np.concatenate([packed for _, packed, _ in layers], axis=0)
    return weights, q4.join_lora([lora for _, _, lora in layers]), layers


def zero_blocks(lora):
    """The packed LoRA before segments: ranks side by side, U block-diagonal with exact zeros, one segment."""
    down, up, splits = lora
    tiles, rank = int(splits[:, 0].sum()), down.shape[1]
    dense, row, tile, column = np.zeros((tiles, rank, q4.TILE), np.float32), 0, 0, 0
    for own_tiles, own in splits.tolist():
        block = up[row : row + own_tiles * own].reshape(own_tiles, own, q4.TILE)
        dense[tile : tile + own_tiles, column : column + own] = block
        row, tile, column = row + own_tiles * own, tile + own_tiles, column + own
    return down, dense.reshape(tiles * rank, q4.TILE), np.array([[tiles, rank]], np.int64)


@settings(max_examples=25, deadline=None)
@given(
    tiles=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    ranks=st.lists(st.sampled_from([0, 1, 5, 32]), min_size=4, max_size=4),
    ragged=st.integers(0, 15),
    rows=st.integers(1, 9),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_segments_keep_each_layers_bits(tiles, ranks, ragged, rows, threads, seed):
    """Siblings in one node, each its own LoRA segment: the reference's bits on every path; each layer's columns
    the bits of that layer alone, and of the packed form before segments (ranks side by side, U block-diagonal):
    its terms of the others' ranks were xa_j · 0 = ±0, which leave a finite partial sum as it is."""
    rng = np.random.default_rng(seed)
    widths = [16 * t for t in tiles]
    widths[-1] -= min(ragged, widths[-1] - 1)  # the last layer may end inside its tile
    weights, lora, layers = siblings(rng, widths, ranks[: len(widths)], 64)
    n = sum(widths)
    assert lora[1].shape == (sum(t * r for t, r in zip(tiles, ranks)), 16)  # compact: no zero blocks
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    expected = q4.reference(x, weights, *lora, n)
    alone = np.concatenate([q4.linear(x, w, *own, m) for m, (_, w, own) in zip(widths, layers)], axis=1)
    assert np.array_equal(expected.view(np.uint32), alone.view(np.uint32))
    for path in q4.available_paths():
        for form in (lora, zero_blocks(lora)):
            got = q4.linear(x, weights, *form, n, path=path, threads=threads)
            assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), path


def test_a_segments_infinity_stays_in_its_own_columns():
    """An infinite x · A of one layer reaches only that layer's columns, as unpacked (in the zero-block form
    inf · 0 made every column NaN)."""
    rng = np.random.default_rng(7)
    weights, (down, up, splits), layers = siblings(rng, [32, 16], [2, 3], 64)
    down = down.copy()
    down[0, 0] = np.inf  # layer 0's first rank column
    x = np.abs(rng.standard_normal((2, 64))).astype(np.float32) + 1
    got = q4.linear(x, weights, down, up, splits, 48)
    assert not np.isfinite(got[:, :32]).any()
    assert np.array_equal(got[:, 32:], q4.linear(x, layers[1][1], *layers[1][2], 16))
    assert np.isnan(q4.linear(x, weights, *zero_blocks((down, up, splits)), 48)[:, 32:]).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_do_not_depend_on_the_call(threads):
    """Row r of an M-row call equals row r alone, for M = 1..64, at real shapes (576 -> 1536, LoRA rank 8)."""
    rng = np.random.default_rng(0)
    _, weights, lora = random_layer(rng, 1536, 576, 8)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    alone = np.concatenate([q4.linear(x[r : r + 1], weights, *lora, 1536, threads=1) for r in range(64)])
    for rows in (1, 2, 3, 4, 8, 16, 64):
        got = q4.linear(x[:rows], weights, *lora, 1536, threads=threads)
        assert np.array_equal(got.view(np.uint32), alone[:rows].view(np.uint32)), rows


def test_close_to_the_exact_product():
    """The op computes x · (d·q + m)^T + (x·A)·U up to the activations' int8 rounding (not some other product)."""
    rng = np.random.default_rng(1)
    (codes, scales, mins), weights, lora = random_layer(rng, 192, 576, 8)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    dense = (codes.reshape(192, -1, 32) * scales[..., None] + mins[..., None]).reshape(192, 576)
    up = lora[1].reshape(-1, 8, 16).transpose(1, 0, 2).reshape(8, -1)[:, :192]
    exact = x.astype(np.float64) @ dense.T + (x.astype(np.float64) @ lora[0]) @ up
    got = q4.linear(x, weights, *lora, 192)
    scale = np.abs(x).max() / 127 * np.abs(dense).sum(axis=1).max()
    assert np.abs(got - exact).max() < 0.5 * scale
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "weights": a["weights"][:-1]}, "packed weights must be"),
        (lambda a: {**a, "x": a["x"][:, :16]}, "in_features must be a positive multiple of 32"),
        (lambda a: {**a, "lora_up": a["lora_up"][:, :1]}, "the LoRA's U must be"),
        (
            lambda a: {**a, "lora_up": a["lora_up"][:-1]},
            r"the LoRA's U must be \[Σ tiles · rank over rank_splits, 16\]",
        ),
        (lambda a: {**a, "lora_a": a["lora_a"][:-32]}, "the LoRA's A must be"),
        (lambda a: {**a, "rank_splits": a["rank_splits"].astype(np.int32)}, "rank_splits must be a rank-2 int64"),
        (lambda a: {**a, "rank_splits": a["rank_splits"][:, :1]}, r"rank_splits must be \[segments, 2\]"),
        (lambda a: {**a, "rank_splits": a["rank_splits"][:0]}, r"1 to 64 of them, got \[0, 2\]"),
        (lambda a: {**a, "rank_splits": np.tile([[1, 0]], (65, 1))}, r"1 to 64 of them, got \[65, 2\]"),
        (lambda a: {**a, "rank_splits": np.array([[1, 2], [0, 0], [1, 0]])}, "tiles must be >= 1 each"),
        (lambda a: {**a, "rank_splits": np.array([[1, 2], [2, 0]])}, "tiles must be >= 1 each and sum to"),
        (lambda a: {**a, "rank_splits": np.array([[1, 3], [1, -1]])}, "ranks must be >= 0 each"),
        (lambda a: {**a, "rank_splits": np.array([[1, 1], [1, 2]])}, "ranks must be >= 0 each and sum to"),
        (lambda a: {**a, "rank_splits": np.array([[1, 1], [1, 0]])}, "must cover every tile and rank column"),
        (lambda a: {**a, "rank_splits": np.array([[1, 2]])}, "must cover every tile and rank column"),
        (lambda a: {**a, "out_features": 0}, "out_features must be in"),
        (lambda a: {**a, "path": "neon"}, "path one of"),
    ],
)
def test_bad_calls_are_one_line_errors(change, message):
    rng = np.random.default_rng(2)
    _, weights, (down, up, splits) = random_layer(rng, 20, 64, 2)
    call = change(
        {
            "x": rng.standard_normal((3, 64)).astype(np.float32),
            "weights": weights,
            "lora_a": down,
            "lora_up": up,
            "rank_splits": splits,
            "out_features": 20,
            "path": "auto",
        }
    )
    with pytest.raises(q4.Q4LinearError, match=message) as error:
        q4.linear(**call)
    assert "\n" not in str(error.value)


def test_pack_refuses_what_it_would_round():
    codes = np.zeros((1, 32), np.uint8)
    with pytest.raises(q4.Q4LinearError, match="fp16 values"):
        q4.pack(codes, np.full((1, 1), 0.1, np.float32), np.zeros((1, 1), np.float32))
    with pytest.raises(q4.Q4LinearError, match="0..15"):
        q4.pack(codes + 16, np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32))


def test_torch_op_and_its_fake():
    torch = pytest.importorskip("torch")
    op = q4.torch_op()
    rng = np.random.default_rng(3)
    _, weights, lora = random_layer(rng, 40, 64, 4)
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)
    tensors = [torch.from_numpy(a) for a in (weights, *lora)]
    got = op(torch.from_numpy(x), *tensors, 40)
    assert got.shape == (1, 5, 40)
    assert np.array_equal(got.numpy()[0], q4.reference(x[0], weights, *lora, 40))

    class Layer(torch.nn.Module):
        def forward(self, x):
            return op(x, *tensors, 40)

    program = torch.export.export(Layer(), (torch.from_numpy(x),))
    assert any(node.target is op for node in program.graph.nodes)


@pytest.mark.parametrize("threads", [1, 2])
def test_onnx_runtime_op_is_the_reference(threads):
    """streamfuse.Q4Linear in ONNX Runtime: each row bit-equal to the reference for 1..64 rows (x of rank 2 to 4)."""
    pytest.importorskip("onnxruntime")
    from streamfuse.tools import q4_bench

    rng = np.random.default_rng(4)
    layers = [q4_bench.random_layer(rng, 200, 64, rank=4), q4_bench.random_layer(rng, 48, 96, rank=0)]
    session = q4_bench.onnx_session(q4_bench.onnx_model(layers, "ours"), threads)
    for rows in (1, 2, 3, 4, 8, 64):
        x64, x96 = (rng.standard_normal((1, rows, k)).astype(np.float32) for k in (64, 96))
        got = session.run(None, {"x64": x64, "x96": x96})
        for layer, x, y in zip(layers, (x64, x96), got):
            weights = q4.pack(layer["codes"], layer["scales"], layer["mins"])
            lora = q4.pack_lora(layer["down"], layer["up"], 2.0, layer["n"], layer["k"])
            expected = q4.reference(x[0], weights, *lora, layer["n"])
            assert y.shape == (1, rows, layer["n"]) and np.array_equal(y[0], expected), rows


def test_onnx_runtime_op_refuses_bad_shapes():
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    from streamfuse.tools import q4_bench

    layer = q4_bench.random_layer(np.random.default_rng(5), 32, 64, rank=2)
    weights = q4.pack(layer["codes"], layer["scales"], layer["mins"])[:, :1]  # half the blocks
    lora = q4.pack_lora(layer["down"], layer["up"], 2.0, 32, 64)
    inits = [numpy_helper.from_array(a, n) for n, a in zip("wabs", (weights, *lora))]
    node = helper.make_node("Q4Linear", ["x", "w", "a", "b", "s"], ["y"], domain="streamfuse", out_features=32)
    graph = helper.make_graph(
        [node],
        "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 32])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("streamfuse", 1)], ir_version=10
    )
    session = q4_bench.onnx_session(model.SerializeToString(), 1)
    with pytest.raises(
        ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="q4_linear: the packed weights must be"
    ):
        session.run(None, {"x": np.zeros((1, 2, 64), np.float32)})


def test_executorch_kernel_is_the_reference():
    """streamfuse::q4_linear.out in an ExecuTorch program (beside an XNNPACK-delegated op): the reference's bits, for
    a layer of two segments and one without LoRA."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("executorch", reason="the executorch extra is not installed")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from streamfuse.export.q4_kernel import _tensor
    from streamfuse.runtime.ops.kernel_library import load_executorch_kernels

    rng = np.random.default_rng(6)
    weights, lora, _ = siblings(rng, [32, 8], [4, 2], 64)  # a packed node: two segments
    empty = no_lora(40, 64)  # a layer without LoRA: empty tensors, which ExecuTorch takes with torch's strides
    op = q4.torch_op()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            names = ("weights", "lora_a", "lora_up", "splits", "none_a", "none_up", "none_splits")
            for name, array in zip(names, (weights, *lora, *empty)):
                self.register_buffer(name, _tensor(array))

        def forward(self, x):
            return (
                torch.relu(x) + 1,
                op(x, self.weights, self.lora_a, self.lora_up, self.splits, 40),
                op(x, self.weights, self.none_a, self.none_up, self.none_splits, 40),
            )

    x = rng.standard_normal((1, 3, 64)).astype(np.float32)
    program = to_edge_transform_and_lower(
        torch.export.export(Layer(), (torch.from_numpy(x),)), partitioner=[XnnpackPartitioner()]
    ).to_executorch()
    load_executorch_kernels()
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    outputs = method.execute([torch.from_numpy(x)])
    assert np.array_equal(outputs[1].numpy()[0], q4.reference(x[0], weights, *lora, 40))
    assert np.array_equal(outputs[2].numpy()[0], q4.reference(x[0], weights, *empty, 40))
