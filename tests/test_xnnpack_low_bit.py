"""q4-native on XNNPACK (export/xnnpack_low_bit.py): the GGUF's codes with bf16 scales, the fp32
min term and LoRA beside them, the head in int8 per channel; every linear delegated to XNNPACK and
row-invariant (row i of an M-row call equals that row alone, bit for bit)."""

import pytest
import torch

from streamfuse.export.low_bit import Q4Linear, Q8Linear
from streamfuse.export.xnnpack_low_bit import XnnpackQ4Linear, XnnpackQ8Embedding, XnnpackQ8Head

from test_low_bit import random_codes

pytest.importorskip("torchao", reason="the executorch extra (torchao) is not installed")


def q4_layer(lora: bool = True) -> Q4Linear:
    torch.manual_seed(3)
    update = (torch.randn(4, 64) * 0.1, torch.randn(96, 4) * 0.1, 2.0) if lora else None
    return Q4Linear(random_codes("q4_1", 96, 64, seed=1), update)


def test_q4_weights_move_only_by_the_bf16_rounding_of_each_scale():
    layer = q4_layer()
    xnnpack = XnnpackQ4Linear(layer)
    scales = layer.scales.reshape(96, 2).double()
    rounding = (scales - scales.float().to(torch.bfloat16).double()).abs()  # per block
    error = (xnnpack.dequantized() - layer.dequantized()).abs().reshape(96, 2, 32)
    assert bool((error <= 8 * rounding[..., None] + 1e-7).all())
    assert float(error.max()) > 0  # random fp16 scales do not all fit bf16
    assert torch.equal(
        xnnpack.base.weight.qdata.reshape(96, 2, 32).float() + 8,
        torch.stack([layer.packed & 15, layer.packed >> 4], -1).reshape(96, 2, 32).float(),
    )


def test_q4_linear_keeps_lora_and_the_min_term_in_fp32():
    layer, x = q4_layer(), torch.randn(5, 64)
    xnnpack = XnnpackQ4Linear(layer)
    assert torch.equal(xnnpack.left.weight, layer.left.T) and xnnpack.left.weight.dtype == torch.float32
    # eager torchao quantizes activations to int8 per token: close to the fp32 layer, not equal
    assert torch.allclose(xnnpack(x), layer(x), atol=0.02 * float(layer(x).abs().max()))


def test_the_embedding_reads_the_heads_int8_codes():
    head = XnnpackQ8Head.from_q8(Q8Linear.from_codes(random_codes("q8_0", 80, 64, seed=2)))
    ids = torch.tensor([[0, 7, 79]])
    assert torch.equal(XnnpackQ8Embedding(head)(ids), head.weight.dequantize()[ids])
    exact = Q8Linear.from_codes(random_codes("q8_0", 80, 64, seed=2)).dequantized()
    steps = exact.abs().max(1, keepdim=True).values / 127  # per-channel int8: half a step at most
    assert bool(((head.weight.dequantize() - exact).abs() <= steps / 2 + 1e-6).all())


def test_the_draft_vocabularys_head_rows_keep_the_heads_codes():
    head = XnnpackQ8Head.from_q8(Q8Linear.from_codes(random_codes("q8_0", 80, 64, seed=2)))
    ids, x = torch.tensor([3, 0, 41]), torch.randn(2, 64)
    rows = head.rows(ids)
    for name in ("qdata", "scale", "zero_point"):
        assert torch.equal(getattr(rows.weight, name), getattr(head.weight, name)[ids])
    assert rows.weight.shape == (3, 64) and head.weight.shape == (80, 64)
    assert torch.allclose(rows(x), head(x)[:, ids], atol=1e-5)
    torch.export.export(rows, (x,), strict=False)  # the quantized tensor's shape is its codes' shape


class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        head = Q8Linear.from_codes(random_codes("q8_0", 80, 64, seed=2))
        self.embed, self.q4 = XnnpackQ8Embedding(XnnpackQ8Head.from_q8(head)), XnnpackQ4Linear(q4_layer())
        self.head = XnnpackQ8Head.from_q8(head)

    def forward(self, ids, x):
        return self.embed(ids), self.q4(x), self.head(x)


def test_xnnpack_takes_every_linear_and_its_rows_do_not_depend_on_the_call_size():
    """Each size is its own static method, as decode (1 row) and step (T rows) are; 1 and 2 threads."""
    pytest.importorskip("executorch", reason="the executorch extra is not installed")
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from streamfuse.export.to_executorch import partitioner
    from streamfuse.runtime.backends.runners import set_executorch_threads

    module, sizes = Layers().eval(), (1, 2, 3, 4, 5, 8, 16)
    programs = {
        f"rows{m}": torch.export.export(module, (torch.zeros(m, dtype=torch.long), torch.randn(m, 64)), strict=False)
        for m in sizes
    }
    lowered = to_edge_transform_and_lower(programs, partitioner=[partitioner("xnnpack")])
    for name in programs:
        left = {str(n.target) for n in lowered.exported_program(name).graph.nodes if n.op == "call_function"}
        assert not {t for t in left if any(op in t for op in ("linear", "mm", "addmm", "convolution"))}, left
    buffer = lowered.to_executorch().buffer
    torch.manual_seed(0)
    ids, x = torch.randint(0, 80, (16,)), torch.randn(16, 64) * 3
    for threads in (1, 2):
        set_executorch_threads(threads)  # then load: a program keeps the pool it was loaded with
        program = Runtime.get().load_program(buffer)
        methods = {m: program.load_method(f"rows{m}") for m in sizes}
        alone = [
            torch.cat(parts)
            for parts in zip(
                *([t.clone() for t in methods[1].execute([ids[i : i + 1], x[i : i + 1]])] for i in range(16))
            )
        ]
        for m in sizes:
            outputs = [t.clone() for t in methods[m].execute([ids[:m].clone(), x[:m].clone()])]
            for label, out, ref in zip(("embedding", "q4", "head"), outputs, alone):
                assert torch.equal(out, ref[:m]), (label, m, threads)
    eager = module(ids[:4], x[:4])
    assert torch.allclose(outputs[1][:4], eager[1], atol=1e-2 * float(eager[1].abs().max()))
