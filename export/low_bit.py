"""Low-bit linear layers for export: the base model's own GGUF codes (q4-native) or int8 blocks.

`q4-native` swaps every base linear layer, with its LoRA update if it has one, for `Q4Linear`, and
the tied embedding / LM head for `Q8Embedding` / `Q8Linear`, keeping LoRA unmerged in fp32 beside
the 4-bit base. Each computes what the GGUF means, with no re-quantization:

    Q4_1:  y = x · (d·(q - 8))^T + (x · L) · R     L = [S | A^T], R = [M + 8D ; s·B^T]
           S [K, K/32] sums x over each block of 32 (0 / 1), M = mins, D = scales (ZERO_POINT);
           A, B, s: the layer's LoRA (absent: L = S, R = M + 8D)
    Q8_0:  y = x · (d·(q - 128))^T       (the int8 q stored as q + 128)

The 4-bit and 8-bit products are custom ops (`streamfuse::q4_matmul`, `streamfuse::q8_linear`) with
an eager implementation here and an ONNX translation to ONNX Runtime's MatMulNBits (4 and 8 bits,
block 32, zero point 8 and 128), so both compute d·(q - zero point) exactly; the min term and the
LoRA update share two small fp32 matmuls (in ONNX 4 nodes a layer instead of 8).
The eager implementation keeps activations in fp32; in the graphs ONNX Runtime quantizes them to
int8 per row and block (export/to_onnx.py ACCURACY_LEVEL). Weights are held in MatMulNBits'
layout: B [N, K/32, 32·bits/8] uint8, low nibble first.

`int8` swaps the same layers (LoRA merged first) for Q8Linear with codes made from the fp32
weights: symmetric, one fp32 scale per block of 32, the Q8_0 layout with exact fp32 scales.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.gguf_codes import BLOCK, BaseCodes, BlockCodes, GGUFError

# The largest |dequantized codes - the model's fp32 weight| accepted as "the same weights": the
# fp32 base is fl(d·q + m), one rounding away from the exact value.
MATCH_TOLERANCE = 1e-6


@torch.library.custom_op("streamfuse::q4_matmul", mutates_args=())
def q4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, out_features: int
) -> torch.Tensor:
    """x [.., K]; packed [N, K/32, 16] uint8; scales [N·K/32]; zero_points [N·ceil(K/64)] uint8, two per
    byte -> x · (d·(q - zero point))^T [.., N] (Q4Linear adds the offsets)."""
    zeros = block_zero_points(zero_points, out_features, packed.shape[1])[..., None]
    codes = unpack_nibbles(packed).float() - zeros.float()  # [N, K/32, 32]
    return x @ (codes * scales.reshape(out_features, -1, 1)).reshape(out_features, -1).T


def block_zero_points(zero_points: torch.Tensor, out_features: int, groups: int) -> torch.Tensor:
    """[N·ceil(K/64)] uint8, two 4-bit zero points per byte -> [N, K/32] uint8."""
    return unpack_nibbles(zero_points.reshape(out_features, -1), pairs=True)[:, :groups]


@q4_matmul.register_fake
def _(x, packed, scales, zero_points, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("streamfuse::q8_linear", mutates_args=())
def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [.., K]; codes [N, K/32, 32] uint8 (q + 128); scales [N·K/32] -> [.., N]."""
    return x @ q8_weight(codes, scales, out_features).T


def q8_weight(codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """[N, K] fp32: the exact weights of Q8 codes [N, K/32, 32] (q + 128) and scales [N·K/32]."""
    return ((codes.float() - 128.0) * scales.reshape(out_features, -1, 1)).reshape(out_features, -1)


@q8_linear.register_fake
def _(x, codes, scales, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes 0..15 -> [N, K/32, 16] uint8, element 2j in the low nibble of byte j."""
    pairs = codes.reshape(codes.shape[0], -1, BLOCK // 2, 2).astype(np.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """pack_nibbles' inverse: [N, K/32, 16] -> [N, K/32, 32] uint8 (pairs: [.., B] -> [.., 2B])."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return nibbles.reshape(*packed.shape[:-1], -1) if pairs else nibbles.reshape(*packed.shape[:-1], BLOCK)


# Q4_1's codes q in 0..15 go to MatMulNBits as d·(q - 8), the offset m + 8d joining the min term: the
# same weights (both partial terms are exact in fp32, so d·(q - 8) + (m + 8d) rounds as d·q + m does),
# but the part the kernel multiplies by int8-quantized activations is centred, which halves the
# activations' quantization error (docs/export.md). uint8 zero points keep prepacking.
# A block where m + 8d would round keeps zero point 0 (centred_zero_points).
ZERO_POINT = 8


# ONNX Runtime's fp32 GEMM sums K in blocks whose size depends on the columns each thread takes (MLAS
# MlasSgemmOperation's StrideK, 128 and up): a weight it did not prepack gives a row other bits at another thread
# split. Sums of at most this many terms are one block whatever the split.
ONE_BLOCK = 128


def low_rank(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, inputs: bool = False) -> torch.Tensor:
    """(x · left) · right. inputs: left and right are graph inputs (a task's LoRA, export/task_inputs.py), which ONNX
    Runtime packs on every call: x · left is then summed in slices of K of at most ONE_BLOCK terms (one batched
    MatMul, the slices added in order by one ReduceSum), and a lone row runs as two (its copy dropped after), since
    one row takes MLAS's separate M = 1 kernel. Either way a row's bits do not depend on the call's size or threads,
    so decode's rows are a tree step's and SS stays plain decoding. (right's K, groups + rank, is one block.)"""
    if not inputs:
        return (x @ left) @ right
    lone = x.shape[-2] == 1
    rows = torch.cat([x, x], dim=-2) if lone else x
    depth, width = left.shape
    size = max(d for d in range(1, ONE_BLOCK + 1) if depth % d == 0)
    slices = rows.reshape(-1, depth // size, size).transpose(0, 1)  # [K / size, M, size]
    product = (slices @ left.reshape(depth // size, size, width)).sum(0).reshape(*rows.shape[:-1], width) @ right
    return product[..., :1, :] if lone else product


class Q4Linear(nn.Module):
    """A Q4_1 linear layer (no bias) on its GGUF codes, with its LoRA update (A [r, K], B [N, r],
    scaling s) if it has one: y = x · (d·(q - 8))^T + (x · left) · right (the module docstring)."""

    def __init__(self, codes: BlockCodes, lora: tuple[torch.Tensor, torch.Tensor, float] | None = None):
        super().__init__()
        if codes.kind != "q4_1":
            raise GGUFError(f"Q4Linear takes Q4_1 codes, got {codes.kind}")
        self.out_features, self.in_features = codes.shape
        self.register_buffer("packed", torch.from_numpy(pack_nibbles(codes.codes)))
        self.register_buffer("scales", torch.from_numpy(codes.scales.reshape(-1).copy()))
        groups = self.in_features // BLOCK
        zeros = centred_zero_points(codes)  # [N, K/32]
        padded = np.zeros((self.out_features, groups + groups % 2), dtype=np.uint8)
        padded[:, :groups] = zeros
        # two 4-bit zero points per byte, the first in the low nibble
        self.register_buffer("zero_points", torch.from_numpy((padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(-1)))
        offsets = torch.from_numpy((codes.mins + zeros.astype(np.float32) * codes.scales).T.copy())  # [K/32, N]
        sums = torch.eye(groups).repeat_interleave(BLOCK, dim=0)  # [K, K/32]: x · sums = x summed per block
        if lora is None:
            left, right = sums, offsets
        else:
            down, up, scaling = lora
            left = torch.cat([sums, down.detach().float().T], dim=1)
            right = torch.cat([offsets, up.detach().float().T * scaling], dim=0)
        self.register_buffer("left", left.contiguous())
        self.register_buffer("right", right.contiguous())
        self.adapted = lora is not None  # left / right hold the task's LoRA: graph inputs (export/task_inputs.py)
        self.task_input = False  # set where left / right are graph inputs: low_rank's exact form for them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q4_matmul(x, self.packed, self.scales, self.zero_points, self.out_features) + low_rank(
            x, self.left, self.right, self.task_input
        )

    @property
    def offsets_t(self) -> torch.Tensor:
        """[K/32, N] the offsets m + zero point · d (the rows of `right` the block sums multiply)."""
        return self.right[: self.in_features // BLOCK]

    def block_zeros(self) -> torch.Tensor:
        """[N, K/32] uint8: each block's zero point (ZERO_POINT, or 0 where the offset would round)."""
        return block_zero_points(self.zero_points, self.out_features, self.in_features // BLOCK)

    def dequantized(self) -> torch.Tensor:
        """[N, K] float64: d·(q - zero point) + offset, the GGUF's weights (LoRA aside)."""
        codes = unpack_nibbles(self.packed).double() - self.block_zeros().double()[..., None]
        scales = self.scales.reshape(self.out_features, -1).double()
        return (codes * scales[..., None] + self.offsets_t.T.double()[..., None]).reshape(self.out_features, -1)


def centred_zero_points(codes: BlockCodes) -> np.ndarray:
    """[N, K/32] uint8: ZERO_POINT for each block whose m + 8d is exact in fp32 (GGUF's fp16 d and m,
    unless their exponents lie more than 13 apart: every block of SmolLM2), else 0 (that block keeps
    d·q + m as it is), so the weights are d·q + m bit for bit either way."""
    offsets = codes.mins + np.float32(ZERO_POINT) * codes.scales
    exact = offsets.astype(np.float64) == codes.mins.astype(np.float64) + ZERO_POINT * codes.scales.astype(np.float64)
    return np.where(exact, ZERO_POINT, 0).astype(np.uint8)


class Q8Linear(nn.Module):
    """A Q8_0 linear layer (no bias): the tied LM head, or some of its rows (draft vocabulary)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features = codes.shape[0]
        self.register_buffer("codes", codes)  # [N, K/32, 32] uint8
        self.register_buffer("scales", scales)  # [N·K/32] fp32

    @classmethod
    def from_codes(cls, codes: BlockCodes) -> Q8Linear:
        if codes.kind != "q8_0":
            raise GGUFError(f"Q8Linear takes Q8_0 codes, got {codes.kind}")
        rows = codes.shape[0]
        return cls(
            torch.from_numpy(codes.codes.reshape(rows, -1, BLOCK).copy()),
            torch.from_numpy(codes.scales.reshape(-1).copy()),
        )

    def rows(self, ids: torch.Tensor) -> Q8Linear:
        """The layer restricted to output rows `ids` (same codes, exact)."""
        scales = self.scales.reshape(self.out_features, -1)[ids].reshape(-1)
        return Q8Linear(self.codes[ids].clone(), scales.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return q8_linear(x, self.codes, self.scales, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """[N, K] fp32: the exact weights."""
        return q8_weight(self.codes, self.scales, self.out_features)


class Q8Embedding(nn.Module):
    """Embedding rows dequantized from the Q8_0 codes the LM head holds (one copy of the codes)."""

    def __init__(self, head: Q8Linear):
        super().__init__()
        self.codes, self.scales = head.codes, head.scales  # the same tensors: stored once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        groups = self.codes.shape[1]
        codes = self.codes[ids].float() - 128.0  # [.., K/32, 32]
        # gathered from the flat scales by index: a reshaped initializer would be a constant-folded
        # copy in every method of the ONNX model (3.5 MB each on SmolLM2)
        scales = self.scales[ids[..., None] * groups + torch.arange(groups)]  # [.., K/32]
        return (codes * scales[..., None]).reshape(*ids.shape, -1)


def use_base_codes(model, codes: BaseCodes) -> dict:
    """q4-native, in place on a SpeculativeStreamingLM whose LoRA is unmerged: every base linear
    layer of the decoder and the tied embedding / LM head compute on the GGUF codes. Checks first
    that the codes are the model's weights. Returns the format's details for the manifest."""
    parts = model.parts
    if len(codes.layers) != parts.num_layers:
        raise GGUFError(f"the GGUF has {len(codes.layers)} layers, the model {parts.num_layers}: another base model")
    _check("embedding", codes.embedding, _tied_weight(parts))
    for index, layer in enumerate(codes.layers):
        for path, block in layer.items():
            _use_q4(parts.layers[index], path, block, f"layer {index} {path}")
    _use_head(model, Q8Linear.from_codes(codes.embedding))
    return {
        "linear": "q4_1 (GGUF codes, exact)",
        "embedding": "q8_0 (GGUF codes, exact)",
        "lm_head": "q8_0, tied to the embedding",
        "lora": "float32, unmerged",
        "gguf_bytes": codes.bytes(),
    }


def quantize_int8(model) -> dict:
    """int8, in place on a SpeculativeStreamingLM whose LoRA is merged: every linear layer of the
    decoder and the tied embedding / LM head get symmetric int8 weights per block of 32 (d = max|w| / 127)."""
    parts = model.parts
    for layer in parts.layers:
        for path, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear):
                _replace(layer, path, Q8Linear.from_codes(int8_codes(_bias_free(path, module).weight)))
    _use_head(model, Q8Linear.from_codes(int8_codes(_tied_weight(parts))))
    return {
        "linear": "int8 per block of 32 (symmetric)",
        "embedding": "int8 per block of 32",
        "lm_head": "int8, tied to the embedding",
        "lora": "merged",
    }


def int8_codes(weight: torch.Tensor) -> BlockCodes:
    """[N, K] float -> Q8_0-style codes with fp32 scales."""
    blocks = weight.detach().float().numpy().reshape(weight.shape[0], -1, BLOCK)
    scales = np.abs(blocks).max(-1) / 127.0
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
    codes = np.clip(np.rint(blocks * inverse[..., None]), -127, 127) + 128
    return BlockCodes("q8_0", codes.astype(np.uint8).reshape(weight.shape), scales.astype(np.float32), None)


def _bias_free(path: str, linear: nn.Linear) -> nn.Linear:
    if linear.bias is not None:
        raise GGUFError(f"{path} has a bias; the low-bit formats take bias-free linear layers")
    return linear


def _replace(layer: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(layer.get_submodule(parent), name, module)


def _tied_weight(parts) -> torch.Tensor:
    if parts.lm_head.weight is not parts.embed.weight:
        raise GGUFError("the low-bit formats keep the tied embedding / LM head once; this model's head is not tied")
    return parts.embed.weight


def _use_head(model, head: Q8Linear) -> None:
    """The LM head and the embedding on one set of Q8 codes."""
    embed, lm_head = model.parts.embed, model.parts.lm_head
    model.replace_modules(lambda module: module is embed, lambda _: Q8Embedding(head))
    model.replace_modules(lambda module: module is lm_head, lambda _: head)


def _use_q4(layer: nn.Module, path: str, codes: BlockCodes, name: str) -> None:
    """Replace the linear at `path` (peft's LoRA layer, or a plain one) by Q4Linear on its codes and LoRA."""
    from peft.tuners.lora import LoraLayer

    owner = layer.get_submodule(path)
    base, lora = (owner.base_layer, _lora_update(owner, name)) if isinstance(owner, LoraLayer) else (owner, None)
    _check(name, codes, _bias_free(path, base).weight)
    _replace(layer, path, Q4Linear(codes, lora))


def _lora_update(owner, name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A, B, scaling) of a peft LoRA layer's one active adapter (plain LoRA: no DoRA)."""
    adapters = list(owner.active_adapters)
    if len(adapters) != 1 or owner.use_dora.get(adapters[0], False):
        raise GGUFError(
            f"{name}: q4-native takes one plain LoRA adapter per layer, found {adapters} "
            f"(DoRA: {owner.use_dora}); export with --quantize none or int8"
        )
    adapter = adapters[0]
    return owner.lora_A[adapter].weight, owner.lora_B[adapter].weight, float(owner.scaling[adapter])


def _check(name: str, codes: BlockCodes, weight: torch.Tensor) -> None:
    if codes.shape != tuple(weight.shape):
        raise GGUFError(
            f"{name}: the GGUF holds a {codes.shape} weight, the model {tuple(weight.shape)}: the GGUF is "
            f"not this model's base: export with --quantize none or int8"
        )
    error = float(np.abs(codes.dequantize() - weight.detach().float().numpy()).max())
    if error > MATCH_TOLERANCE:
        raise GGUFError(
            f"{name}: the GGUF's codes differ from the model's weights by up to {error:.3g}; the GGUF is "
            f"not this model's base: export with --quantize none or int8"
        )
