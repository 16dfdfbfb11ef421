"""q4-native on ExecuTorch / XNNPACK: the closest form XNNPACK's quantized kernels can hold.

XNNPACK's 4-bit weights are symmetric (int4 codes, no zero point) with one bf16 scale per block of
32, and its int8 weights have one scale per output channel. So, from the ONNX form (low_bit.py):

    Q4_1:  y = qd8·qb4w(x, q - 8, bf16(d)) + (x · L) · R,   R = [M + 8D ; s·B^T] as in Q4Linear
    Q8_0 (tied embedding / LM head): int8 per output channel, re-quantized from its exact values

The codes and the min term are the GGUF's; what changes is the scale: d is an fp16 value (11
significant bits), bf16 keeps 8, so a weight moves by |d - bf16(d)|·|q - 8| (at most 2^-8·8·d),
and the head's per-channel int8 steps are coarser than Q8_0's per-block ones. Both errors are
measured here against the exact weights and recorded in the manifest (graphs.formats). torchao's
zero-point-capable low-bit kernels (torchao.experimental) are built for Arm only, not in the x86
wheel, so XNNPACK's kernels it is. Activations are int8 per token, dynamic (XNNPACK's qd8).
"""

from __future__ import annotations

import torch
from torch import nn

from streamfuse.adapters.gguf_codes import BLOCK
from streamfuse.export.low_bit import ZERO_POINT, Q4Linear, Q8Embedding, Q8Linear, unpack_nibbles
from streamfuse.export.to_executorch import torchao_config


def _quantize(linear: nn.Linear, config) -> nn.Linear:
    from torchao.quantization import quantize_

    holder = nn.Sequential(linear)  # quantize_ converts submodules
    quantize_(holder, config)
    return holder[0]


def _linear(matrix: torch.Tensor) -> nn.Linear:
    """x @ matrix as a linear layer ([K, N] -> weight [N, K])."""
    linear = nn.Linear(*matrix.shape, bias=False)
    linear.weight = nn.Parameter(matrix.T.contiguous(), requires_grad=False)
    return linear


class XnnpackQ4Linear(nn.Module):
    """Q4Linear's layer on XNNPACK: the codes q - 8 with scale bf16(d) in torchao's 8da4w form (what
    XNNPACK's qd8-f32-qb4w kernel takes), plus Q4Linear's two fp32 matmuls (min term and LoRA)."""

    def __init__(self, layer: Q4Linear):
        super().__init__()
        rows, groups = layer.out_features, layer.in_features // BLOCK
        zeros = layer.block_zeros().float()  # [N, K/32]
        codes = unpack_nibbles(layer.packed).float() - ZERO_POINT  # q - 8 in every block
        scales = layer.scales.reshape(rows, groups)
        shift = ZERO_POINT - zeros  # a block Q4Linear kept at zero point 0 (offset m) gets offset m + 8d
        linear = nn.Linear(layer.in_features, rows, bias=False)
        linear.weight.data = (codes * scales[..., None]).reshape(rows, -1)
        self.base = _quantize(linear, torchao_config("8da4w"))  # 8da4w's groups are GGUF's blocks of 32
        weight = self.base.weight  # torchao re-derives its own scales: put the GGUF's codes and scales back
        weight.qdata.copy_(codes.reshape(rows, -1).to(torch.int8))
        weight.scale.copy_(scales)
        weight.zero_point.zero_()
        right = layer.right.clone()
        right[:groups] += (shift * scales).T  # fp32, like the offsets themselves
        self.groups = groups
        # linear layers with parameters, not matmuls with buffers: XNNPACK lowers only those
        self.left, self.right = _linear(layer.left), _linear(right)
        self.adapted = layer.adapted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.right(self.left(x))

    def dequantized(self) -> torch.Tensor:
        """[N, K] float64: the weights XNNPACK computes with (scales rounded to bf16, as it stores them)."""
        weight = self.base.weight
        scales = weight.scale.to(torch.bfloat16).double()
        codes = weight.qdata.double().reshape(*scales.shape, BLOCK)
        offsets = self.right.weight[:, : self.groups].double()  # [N, K/32]
        return (codes * scales[..., None] + offsets[..., None]).reshape(weight.qdata.shape)


class XnnpackQ8Head(nn.Module):
    """The tied LM head in int8 per output channel (XNNPACK's qd8-f32-qc8w), from Q8_0's exact values."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight.float()
        self.base = _quantize(linear, torchao_config("int8"))

    @classmethod
    def from_q8(cls, head: Q8Linear) -> XnnpackQ8Head:
        return cls(head.dequantized())

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def rows(self, ids: torch.Tensor) -> XnnpackQ8Head:
        """The head restricted to output rows `ids` (the draft vocabulary): the same codes and scales
        (torchao would derive its own from the dequantized rows: put the head's back)."""
        part = XnnpackQ8Head(self.weight.dequantize()[ids])
        for name in ("qdata", "scale", "zero_point"):
            getattr(part.weight, name).copy_(getattr(self.weight, name)[ids])
        return part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)


class XnnpackQ8Embedding(nn.Module):
    """Embedding rows from the head's per-channel int8 codes (a gather: ExecuTorch's portable ops)."""

    def __init__(self, head: XnnpackQ8Head):
        super().__init__()
        weight = head.weight
        self.register_buffer("codes", weight.qdata.clone())  # [V, K] int8
        self.register_buffer("scales", weight.scale.reshape(-1).float().clone())  # [V]
        zero = weight.zero_point.reshape(-1).float()
        if bool(zero.abs().max() > 0):
            raise ValueError("the head's int8 codes have zero points; the embedding expects symmetric codes")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes[ids].float() * self.scales[ids][..., None]


def use_xnnpack_codes(model) -> dict:
    """In place on a model that use_base_codes made q4-native: each Q4Linear, the Q8_0 head and the
    embedding in XNNPACK's closest form. Returns the largest weight errors against the exact
    weights (the GGUF's dequantized codes, LoRA aside) for the manifest."""
    heads = [m for m in model.modules() if isinstance(m, Q8Linear)]
    if len(heads) != 1 or not any(isinstance(m, Q8Embedding) for m in model.modules()):
        raise ValueError("use_xnnpack_codes takes a q4-native model (low_bit.use_base_codes) with its tied Q8 head")
    linear_error = 0.0

    def convert(layer: Q4Linear) -> XnnpackQ4Linear:
        nonlocal linear_error
        xnnpack = XnnpackQ4Linear(layer)
        linear_error = max(linear_error, float((xnnpack.dequantized() - layer.dequantized()).abs().max()))
        return xnnpack

    model.replace_modules(lambda m: isinstance(m, Q4Linear), convert)
    head = XnnpackQ8Head.from_q8(heads[0])
    head_error = float((head.weight.dequantize().double() - heads[0].dequantized().double()).abs().max())
    model.replace_modules(lambda m: isinstance(m, Q8Embedding), lambda _: XnnpackQ8Embedding(head))
    model.replace_modules(lambda m: m is heads[0], lambda _: head)
    return {
        "linear": "q4_1 codes as q - 8 with bf16 scales (XNNPACK qb4w) + fp32 min term",
        "embedding": "int8 per row (re-quantized from q8_0)",
        "lm_head": "int8 per channel (re-quantized from q8_0)",
        "max_weight_error": {"linear": linear_error, "lm_head": head_error},
    }
