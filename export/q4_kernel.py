"""q4-native on streamfuse's own ops: the linears on the 4-bit op (runtime/ops/q4_linear.py), the tied LM head and
embedding on the Q8_0 op's codes (runtime/ops/q8_linear.py): one node a layer.

Q4Linear (export/low_bit.py) keeps the GGUF's codes with ONNX Runtime's MatMulNBits and puts the Q4_1 minimums
and the LoRA into an fp32 low-rank term (4 nodes, a [K, K/32] block-sum matrix and fp32 offsets beside the
codes). KernelQ4Linear holds the same weights as the op's tiles (the file's bytes: codes, fp16 scales and
minimums) and the LoRA unmerged in fp32, and computes y = x · (d·q + m)^T + (x · A) · s·B^T in one call whose
rows keep their bits whatever the call (the op's header says how). KernelQ8Head holds the head's Q8_0 blocks in the
Q8 op's flat layout and KernelQ8Embedding gathers its rows from those same tensors by index: one copy of the
codes, the same exact values as Q8Embedding's.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.gguf_codes import BLOCK
from streamfuse.export.low_bit import Q4Linear, Q8Embedding, Q8Linear, unpack_nibbles
from streamfuse.runtime.ops import q4_linear, q8_linear


class KernelQ4Linear(nn.Module):
    """A Q4Linear's weights and LoRA in the op's layout; `left` / `right` are the LoRA (A^T [K, r], s·B^T by tile
    [tiles·r, 16]), the names task inputs look for (export/task_inputs.py); `rank_splits` [[tiles, r]]: one segment
    (export/onnx_pack.py joins siblings' into one node's)."""

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
        left, right, splits = q4_linear.pack_lora(down, up, 1.0, self.out_features, self.in_features)
        self.register_buffer("left", _tensor(left))
        self.register_buffer("right", _tensor(right))
        self.register_buffer("rank_splits", torch.from_numpy(splits))
        self.adapted = layer.adapted
        self.task_input = False  # the op's LoRA is row-wise either way (export/task_inputs.py sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q4_linear.torch_op()(x, self.weights, self.left, self.right, self.rank_splits, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float64: d·q + m, the GGUF's weights (LoRA aside)."""
        codes, scales, mins = q4_linear.unpack(self.weights.numpy(), self.out_features)
        blocks = codes.reshape(self.out_features, -1, BLOCK).astype(np.float64)
        weights = blocks * scales[..., None].astype(np.float64) + mins[..., None].astype(np.float64)
        return torch.from_numpy(weights.reshape(self.out_features, -1))


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor of `array`; an empty one (no LoRA) with torch's own strides: NumPy gives a [K, 0] array stride 0
    on K, which ExecuTorch refuses."""
    return torch.from_numpy(array) if array.size else torch.zeros(array.shape, dtype=torch.float32)


class KernelQ8Head(nn.Module):
    """A Q8_0 linear (the LM head, or its draft-vocabulary rows) on the Q8 op: codes int8 and scales float32, flat."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        flat_codes, flat_scales = q8_linear.pack(codes, scales)
        self.register_buffer("codes", torch.from_numpy(flat_codes))
        self.register_buffer("scales", torch.from_numpy(flat_scales))

    @classmethod
    def from_q8(cls, head: Q8Linear) -> KernelQ8Head:
        rows = head.out_features
        codes = (head.codes.reshape(rows, -1).numpy().astype(np.int16) - 128).astype(np.int8)  # stored as q + 128
        return cls(codes, head.scales.reshape(rows, -1).numpy())

    def weights(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes [N, K] int8, scales [N, K/32] float32)."""
        return q8_linear.unpack(self.codes.numpy(), self.scales.numpy(), self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor) -> KernelQ8Head:
        """The head restricted to output rows `ids` (the same codes, exact): graph_passes.head_rows."""
        codes, scales = self.weights()
        return KernelQ8Head(codes[ids.numpy()], scales[ids.numpy()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q8_linear.torch_op()(x, self.codes, self.scales, self.out_features)

    def dequantized(self) -> torch.Tensor:
        codes, scales = self.weights()
        blocks = codes.reshape(self.out_features, -1, BLOCK).astype(np.float32) * scales[..., None]
        return torch.from_numpy(blocks.reshape(self.out_features, -1))


class KernelQ8Embedding(nn.Module):
    """Embedding rows dequantized from the head's flat codes, gathered element by element (one 1-D Gather on the
    codes and one on the scales: no reshaped copy of them in any graph), values as Q8Embedding's (q·d, exact)."""

    def __init__(self, head: KernelQ8Head):
        super().__init__()
        self.codes, self.scales = head.codes, head.scales  # the same tensors: stored once
        self.blocks = head.in_features // BLOCK
        index = q8_linear.embedding_index(head.out_features, head.in_features)
        for name, array in zip(("code_base", "code_offset", "scale_base", "scale_offset"), index):
            self.register_buffer(name, torch.from_numpy(array))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[self.code_base[ids][..., None] + self.code_offset].float()  # [.., K]
        scales = self.scales[self.scale_base[ids][..., None] + self.scale_offset]  # [.., K/32]
        return (codes.reshape(*ids.shape, self.blocks, BLOCK) * scales[..., None]).reshape(*ids.shape, -1)


def use_kernel_linears(model: nn.Module, head: bool = False) -> dict:
    """In place on a q4-native model (low_bit.use_base_codes): every Q4Linear -> KernelQ4Linear, and with `head` the
    tied Q8 head and embedding -> KernelQ8Head / KernelQ8Embedding. Returns the format's details for the manifest,
    with the largest weight difference (0: the same weights)."""
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
    details = {
        "linear": "q4_1 codes in streamfuse's own op (runtime/ops/q4_linear.py), LoRA unmerged in fp32",
        "max_weight_error": {"linear": error},
    }
    if head:
        details = {**details, **_use_kernel_head(model)}
        details["max_weight_error"] = {"linear": error, "lm_head": details.pop("head_error")}
    return details


def _use_kernel_head(model: nn.Module) -> dict:
    heads = [m for m in model.modules() if isinstance(m, Q8Linear)]
    if len(heads) != 1 or not any(isinstance(m, Q8Embedding) for m in model.modules()):
        raise ValueError("use_kernel_linears(head=True) takes a q4-native model with its tied Q8 head")
    kernel = KernelQ8Head.from_q8(heads[0])
    head_error = float((kernel.dequantized().double() - heads[0].dequantized().double()).abs().max())
    model.replace_modules(lambda m: isinstance(m, Q8Embedding), lambda _: KernelQ8Embedding(kernel))
    model.replace_modules(lambda m: m is heads[0], lambda _: kernel)
    return {
        "lm_head": "q8_0 codes in streamfuse's own op (runtime/ops/q8_linear.py), tied to the embedding",
        "head_error": head_error,
    }
