"""export/low_bit.py: low-bit layers compute what their codes mean, and every row of an exported
call is bit-identical to that row computed alone (what keeps SS == plain decoding exact)."""

import itertools

import numpy as np
import pytest
import torch

from streamfuse.adapters.gguf_codes import BlockCodes
from streamfuse.export.low_bit import (
    Q4Linear,
    Q8Embedding,
    Q8Linear,
    int8_codes,
    low_rank,
    pack_nibbles,
    unpack_nibbles,
)


def random_codes(kind: str, rows: int, columns: int, seed: int = 0) -> BlockCodes:
    rng = np.random.default_rng(seed)
    top = 16 if kind == "q4_1" else 256
    mins = rng.standard_normal((rows, columns // 32)).astype(np.float32) * 0.05 if kind == "q4_1" else None
    scales = (rng.random((rows, columns // 32)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)  # GGUF: fp16
    mins = None if mins is None else mins.astype(np.float16).astype(np.float32)
    return BlockCodes(kind, rng.integers(0, top, (rows, columns)).astype(np.uint8), scales, mins)


def test_nibbles_pack_in_matmulnbits_order_element_2j_low():
    codes = np.array([list(range(16)) * 2])  # one block of 32
    packed = pack_nibbles(codes)
    assert packed.shape == (1, 1, 16)
    assert packed[0, 0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    assert unpack_nibbles(torch.from_numpy(packed)).tolist() == [[codes[0].tolist()]]


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_low_bit_linear_computes_x_times_its_dequantized_weight(kind):
    codes = random_codes(kind, 48, 96)
    layer = Q4Linear(codes) if kind == "q4_1" else Q8Linear.from_codes(codes)
    x = torch.randn(2, 5, 96)
    expected = x @ torch.from_numpy(codes.dequantize()).T
    assert torch.allclose(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_q4_linear_adds_its_lora_update_through_the_min_terms_matmuls():
    """left = [block sums | A^T], right = [offsets ; s·B^T]: the base layer plus LoRA, two matmuls."""
    codes = random_codes("q4_1", 48, 96)
    down, up, scaling = torch.randn(8, 96), torch.randn(48, 8), 2.0
    layer = Q4Linear(codes, (down, up, scaling))
    assert layer.left.shape == (96, 3 + 8) and layer.right.shape == (3 + 8, 48)
    x = torch.randn(2, 5, 96)
    expected = x @ torch.from_numpy(codes.dequantize()).T + (x @ down.T @ up.T) * scaling
    assert torch.allclose(layer(x), expected, atol=1e-4, rtol=1e-4)
    assert torch.allclose(Q4Linear(codes)(x), x @ torch.from_numpy(codes.dequantize()).T, atol=1e-5, rtol=1e-5)


def test_the_embedding_reads_the_head_codes_exactly():
    codes = random_codes("q8_0", 40, 64)
    head = Q8Linear.from_codes(codes)
    embedding = Q8Embedding(head)
    ids = torch.tensor([[3, 0, 39]])
    assert torch.equal(embedding(ids)[0], torch.from_numpy(codes.dequantize())[ids[0]])
    assert embedding.codes is head.codes  # one copy of the codes
    rows = head.rows(torch.tensor([39, 3]))
    assert torch.equal(rows(torch.eye(64)).T, torch.from_numpy(codes.dequantize())[[39, 3]])


def test_int8_codes_round_each_weight_to_the_nearest_step_of_its_block():
    weight = torch.tensor([[1.27, -0.64, 0.006, 0.004] + [0.0] * 28])  # max |w| 1.27 -> step 0.01
    codes = int8_codes(weight)
    assert codes.scales[0, 0] == pytest.approx(0.01)
    assert (codes.codes[0, :4].astype(int) - 128).tolist() == [127, -64, 1, 0]
    assert np.abs(codes.dequantize() - weight.numpy()).max() <= 0.005 + 1e-7


class Linears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q4 = Q4Linear(random_codes("q4_1", 96, 64, seed=1))
        self.q8 = Q8Linear.from_codes(random_codes("q8_0", 80, 64, seed=2))
        self.fp32 = torch.nn.Linear(64, 72, bias=False)

    def forward(self, x):
        return self.q4(x), self.q8(x), self.fp32(x)


def exported_rows(module, example, dims, tmp_path):
    """An ONNX Runtime session per thread count over `module` exported with dynamic rows."""
    ort = pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    from streamfuse.export.to_onnx import custom_translations

    program = torch.export.export(module, example, strict=False, dynamic_shapes=dims)
    path = tmp_path / "rows.onnx"
    torch.onnx.export(program, (), dynamo=True, custom_translation_table=custom_translations(), verbose=False).save(
        str(path)
    )
    sessions = []
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sessions.append(ort.InferenceSession(str(path), options))
    return sessions


def test_onnx_runtime_linear_rows_do_not_depend_on_the_call_size(tmp_path):
    """Row i of an M-row call equals that row alone, bit for bit, for the q4, q8 and fp32 linear
    layers of the exported graphs (M = 1..16, the row anywhere, other rows random, 1 and 2 threads)."""
    torch.manual_seed(0)
    rows = torch.export.Dim("rows", min=1, max=32)
    sessions = exported_rows(Linears().eval(), (torch.randn(1, 4, 64),), ({1: rows},), tmp_path)
    row = torch.randn(1, 1, 64)
    for session in sessions:
        name = session.get_inputs()[0].name
        alone = session.run(None, {name: row.numpy()})
        for count in range(1, 17):
            batch = torch.randn(1, count, 64)
            at = count // 2
            batch[0, at] = row[0, 0]
            outputs = session.run(None, {name: batch.numpy()})
            for label, out, one in zip(("q4", "q8", "fp32"), outputs, alone):
                assert np.array_equal(out[0, at], one[0, 0]), (label, count)


def last_rows(module, inputs: tuple, path) -> dict[int, np.ndarray]:
    """threads -> the last row of `module`'s output, exported with these static shapes and run by ONNX Runtime."""
    ort = pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    torch.onnx.export(torch.export.export(module, inputs, strict=False), (), dynamo=True, verbose=False).save(str(path))
    rows = {}
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options)
        names = [i.name for i in session.get_inputs()]
        (out,) = session.run(None, dict(zip(names, (t.numpy() for t in inputs))))
        rows[threads] = out[0, -1]
    return rows


class LowRank(torch.nn.Module):
    def forward(self, x, left, right):
        return low_rank(x, left, right, inputs=True)


def test_onnx_runtime_low_rank_rows_with_input_weights_do_not_depend_on_the_call_size(tmp_path):
    """A task's LoRA as graph inputs (export/task_inputs.py): ONNX Runtime packs those weights per call, blocks K by
    the thread split and runs a lone row through its one-row kernel; low_rank's input form sums slices of one block
    and runs a lone row as two, so a row's bits are the same in a call of any size, on 1 or 2 threads (the cpu
    preset's shapes: K = 576 and 1536, 18 / 48 block sums + rank 32)."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    torch.manual_seed(0)
    outputs, weights = (
        {},
        {
            depth: (torch.randn(1, 1, depth), torch.randn(depth, depth // 32 + 32), torch.randn(depth // 32 + 32, 576))
            for depth in (576, 1536)
        },
    )
    for (depth, (row, left, right)), count in itertools.product(weights.items(), (1, 2, 4, 5, 8)):
        batch = torch.randn(1, count, depth)
        batch[:, -1] = row[:, 0]
        path = tmp_path / f"low-rank-{depth}-{count}.onnx"
        for threads, out in last_rows(LowRank(), (batch, left, right), path).items():
            outputs[depth, count, threads] = out
    differ = [key for key, out in outputs.items() if not np.array_equal(out, outputs[key[0], 1, 1])]
    assert not differ, differ


def test_q4_codes_go_to_the_kernel_centred_which_halves_the_int8_activation_error(tmp_path):
    """MatMulNBits gets d·(q - 8) and the min term m + 8d: the same weights, but what the kernel
    multiplies by int8-quantized activations is centred. Against the exact product (float64), the
    error of the exported layer is about half that of d·q with zero point 0 and m as the min term."""
    ort = pytest.importorskip("onnxruntime", reason="the onnxruntime extra is not installed")
    from streamfuse.export.to_onnx import custom_translations

    codes = random_codes("q4_1", 256, 512, seed=3)
    centred = Q4Linear(codes)
    assert unpack_nibbles(centred.zero_points.reshape(256, -1), pairs=True).unique().tolist() == [8]
    uncentred = Q4Linear(codes)
    uncentred.zero_points.zero_()
    uncentred.offsets_t.copy_(torch.from_numpy(codes.mins.T.copy()))
    x = torch.randn(1, 4, 512, dtype=torch.float64)  # [batch, rows, K], as in the graphs
    exact = x @ torch.from_numpy(codes.dequantize()).double().T
    errors = []
    for index, layer in enumerate((centred, uncentred)):
        path = tmp_path / f"q4-{index}.onnx"
        program = torch.export.export(layer.eval(), (x.float(),), strict=False)
        torch.onnx.export(program, (), dynamo=True, custom_translation_table=custom_translations(), verbose=False).save(
            str(path)
        )
        session = ort.InferenceSession(str(path))
        (out,) = session.run(None, {session.get_inputs()[0].name: x.float().numpy()})
        errors.append(float(np.abs(out - exact.numpy()).mean()))
    assert errors[0] < 0.7 * errors[1], errors


def test_q4_codes_stay_uncentred_where_the_offset_would_round():
    """A block whose m + 8d does not fit fp32 exactly keeps zero point 0 and m: the weights stay d·q + m."""
    codes = random_codes("q4_1", 2, 96)
    codes.mins[0, 1], codes.scales[0, 1] = 1000.0, 1e-3  # 1000 + 0.008 rounds in fp32
    layer = Q4Linear(codes)
    zeros = unpack_nibbles(layer.zero_points.reshape(2, -1), pairs=True)[:, :3]
    assert zeros.tolist() == [[8, 0, 8], [8, 8, 8]]
    assert layer.offsets_t[1, 0] == 1000.0 and layer.offsets_t[0, 0] == codes.mins[0, 0] + 8 * codes.scales[0, 0]
