"""q4-native linears on streamfuse's own 4-bit op (runtime/q4_linear.py) for ONNX Runtime: one node a layer.

Q4Linear (export/low_bit.py) keeps the GGUF's codes with ONNX Runtime's MatMulNBits and puts the Q4_1 minimums
and the LoRA into an fp32 low-rank term (4 nodes, a [K, K/32] block-sum matrix and fp32 offsets beside the
codes). KernelQ4Linear holds the same weights as the op's tiles (the file's bytes: codes, fp16 scales and
minimums) and the LoRA unmerged in fp32, and computes y = x · (d·q + m)^T + (x · A) · s·B^T in one call whose
rows keep their bits whatever the call (the op's header says how).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.gguf_codes import BLOCK
from streamfuse.export.low_bit import Q4Linear, unpack_nibbles
from streamfuse.runtime import q4_linear


class KernelQ4Linear(nn.Module):
    """A Q4Linear's weights and LoRA in the op's layout; `left` / `right` are the LoRA (A^T [K, r], s·B^T by tile
    [tiles, r, 16]), the names task inputs look for (export/task_inputs.py)."""

    def __init__(self, layer: Q4Linear):
        super().__init__()
        self.out_features, self.in_features = layer.out_features, layer.in_features
        groups = self.in_features // BLOCK
        codes = unpack_nibbles(layer.packed).reshape(self.out_features, -1).numpy()
        scales = layer.scales.reshape(self.out_features, groups)
        # offsets = m + zero point · d, exact by construction (low_bit.centred_zero_points): m comes back exactly
        mins = layer.offsets_t.T - layer.block_zeros().float() * scales
        self.register_buffer("weights", torch.from_numpy(q4_linear.pack(codes, scales.numpy(), mins.numpy())))
        down, up = None, None
        if layer.adapted:
            down = layer.left[:, groups:].T.numpy()  # A [r, K]
            up = layer.right[groups:].T.numpy()  # s·B [N, r], the scaling already in
        left, right = q4_linear.pack_lora(down, up, 1.0, self.out_features, self.in_features)
        self.register_buffer("left", torch.from_numpy(left))
        self.register_buffer("right", torch.from_numpy(right))
        self.adapted = layer.adapted
        self.task_input = False  # the op's LoRA is row-wise either way (export/task_inputs.py sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q4_linear.torch_op()(x, self.weights, self.left, self.right, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float64: d·q + m, the GGUF's weights (LoRA aside)."""
        codes, scales, mins = q4_linear.unpack(self.weights.numpy(), self.out_features)
        blocks = codes.reshape(self.out_features, -1, BLOCK).astype(np.float64)
        weights = blocks * scales[..., None].astype(np.float64) + mins[..., None].astype(np.float64)
        return torch.from_numpy(weights.reshape(self.out_features, -1))


def use_kernel_linears(model: nn.Module) -> dict:
    """In place on a q4-native model (low_bit.use_base_codes): every Q4Linear -> KernelQ4Linear. Returns the format's
    details for the manifest, with the largest weight difference (0: the same weights)."""
    error = 0.0

    def convert(layer: Q4Linear) -> KernelQ4Linear:
        nonlocal error
        kernel = KernelQ4Linear(layer)
        error = max(error, float((kernel.dequantized() - layer.dequantized()).abs().max()))
        return kernel

    count = sum(isinstance(m, Q4Linear) for m in model.modules())
    if count == 0:
        raise ValueError("use_kernel_linears takes a q4-native model (low_bit.use_base_codes): it has no Q4Linear")
    model.replace_modules(lambda m: isinstance(m, Q4Linear), convert)
    return {"linear": "q4_1 codes in streamfuse's own op (runtime/q4_linear.py), LoRA unmerged in fp32",
            "max_weight_error": {"linear": error}}
