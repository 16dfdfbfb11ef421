"""The base model's own low-bit weights, read from its GGUF file as codes and block scales.

The default base model is a Q4_1 GGUF: each linear weight is w = d·q + m per block of 32 input
channels (q in 0..15; d, m fp16), and the tied embedding / LM head is Q8_0 (w = d·q, q int8).
The model we fine-tune is exactly that dequantized base plus the LoRA update, so a low-bit
artifact that keeps these codes as they are is the trained model itself, not an approximation.

Codes come out in the Hugging Face model's row order: llama.cpp stores q_proj and k_proj rows
permuted for its rotary layout, and the rows are put back as transformers does when it loads the
file. Nothing here re-quantizes: the arrays are the file's bits, unpacked.

    BlockCodes.codes  [N, K] uint8   q (Q4_1: 0..15; Q8_0: the int8 q + 128)
    BlockCodes.scales [N, K/32] fp32 d (exact: fp16 -> fp32)
    BlockCodes.mins   [N, K/32] fp32 m (Q4_1), None for Q8_0
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
# GGUF tensor name in a block -> the HF module path inside a decoder layer.
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
EMBEDDING = "token_embd.weight"
KINDS = ("q4_1", "q8_0")
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # per block of 32 weights


class GGUFError(ValueError):
    pass


@dataclass(frozen=True)
class BlockCodes:
    kind: str  # q4_1 | q8_0
    codes: np.ndarray  # [N, K] uint8
    scales: np.ndarray  # [N, K/32] float32
    mins: np.ndarray | None  # [N, K/32] float32 (q4_1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, computed as gguf's own dequantization does (fl(d·q + m); d·q is exact)."""
        blocks = self.codes.reshape(self.shape[0], -1, BLOCK).astype(np.float32)
        if self.kind == "q8_0":
            blocks = blocks - 128.0
        value = blocks * self.scales[..., None]
        if self.mins is not None:
            value = value + self.mins[..., None]
        return value.reshape(self.shape)


@dataclass(frozen=True)
class BaseCodes:
    """Per decoder layer, HF module path -> codes; and the embedding (the tied LM head)."""

    layers: list[dict[str, BlockCodes]]
    embedding: BlockCodes

    def bytes(self) -> int:
        """The file's own size of these tensors (what a GGUF reader maps)."""
        items = [c for layer in self.layers for c in layer.values()] + [self.embedding]
        return sum(c.codes.size // BLOCK * BLOCK_BYTES[c.kind] for c in items)


def read_base_codes(path: Path, num_heads: int, num_kv_heads: int) -> BaseCodes:
    """Every linear weight of the decoder layers and the embedding, as codes in HF row order."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(Path(path))
    except (OSError, ValueError) as error:
        raise GGUFError(f"{path} is not a readable GGUF file ({error}); reinstall the base model package") from None
    tensors = {t.name: t for t in reader.tensors}
    if EMBEDDING not in tensors:
        raise GGUFError(f"{path} has no {EMBEDDING}: not a llama-family GGUF")
    layers, index = [], 0
    while f"blk.{index}.attn_q.weight" in tensors:
        layer = {}
        for name, module in LAYER_TENSORS.items():
            codes = _unpack(tensors[f"blk.{index}.{name}.weight"])
            heads = {"attn_q": num_heads, "attn_k": num_kv_heads}.get(name)
            layer[module] = codes if heads is None else _unpermute(codes, heads)
        layers.append(layer)
        index += 1
    return BaseCodes(layers, _unpack(tensors[EMBEDDING]))


def _unpack(tensor) -> BlockCodes:
    kind = tensor.tensor_type.name.lower()
    if kind not in KINDS:
        raise GGUFError(
            f"{tensor.name} is stored as {tensor.tensor_type.name}; streamfuse keeps the codes of "
            f"{', '.join(k.upper() for k in KINDS)} tensors only: export with --quantize int8 or none"
        )
    rows = int(tensor.shape[-1])  # GGUF lists dims innermost first: [K, N]
    return unpack_blocks(kind, np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1))


def unpack_blocks(kind: str, raw: np.ndarray) -> BlockCodes:
    """[N, bytes] GGUF blocks -> BlockCodes. Q4_1 block (20 bytes): d fp16, m fp16, 16 bytes whose
    low nibbles are elements 0..15 and high nibbles 16..31. Q8_0 block (34 bytes): d fp16, 32 int8."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[kind])
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "q8_0":
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return BlockCodes(kind, codes.reshape(rows, -1), scales, None)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return BlockCodes(kind, codes.reshape(rows, -1), scales, mins)


def _unpermute(codes: BlockCodes, heads: int) -> BlockCodes:
    """Undo llama.cpp's rotary row permutation of q/k (as transformers' GGUF loader does)."""
    order = np.arange(codes.shape[0])
    order = order.reshape(heads, -1, 2).swapaxes(2, 1).reshape(-1)  # HF row r is GGUF row order[r]
    return BlockCodes(
        codes.kind, codes.codes[order], codes.scales[order], None if codes.mins is None else codes.mins[order]
    )
