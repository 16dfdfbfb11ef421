"""Medusa heads (Cai et al. 2024), the SS paper's first baseline: drafts from the target's last hidden state.

Head j is a residual block, h + SiLU(W_j h + b_j), read through the target's shared LM head; it
predicts the token j positions after the next one, as stream j does, so its top-k fill the same
static trees (the streams' drafter). W_j starts at zero, so a new head is the identity and
drafts the next token itself. The target stays frozen (Medusa-1): the heads train on its
final-normed states over its own greedy answers (train.py beside this file).

    <dir>/medusa.json          format version, number of heads, hidden size, info
    <dir>/heads.safetensors    the blocks' weights
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamfuse.adapters.head_files import load_head_weights, residual_blocks, save_head
from streamfuse.head_format import read_head_manifest

MANIFEST = "medusa.json"
FORMAT_VERSION = 1


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs >= 1 head, got {num_heads}")
        self.blocks = residual_blocks(hidden_size, num_heads)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final-normed target states -> [..., heads, H], for the shared LM head."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks], dim=-2)


def save_heads(heads: MedusaHeads, directory: Path, info: dict) -> None:
    """Write the heads and their manifest (last: a folder with one is complete)."""
    save_head(
        heads,
        directory,
        MANIFEST,
        {
            "format_version": FORMAT_VERSION,
            "num_heads": heads.num_heads,
            "hidden_size": heads.blocks[0].in_features,
            "info": info,
        },
    )


def read_heads_manifest(directory: Path) -> dict:
    return read_head_manifest(directory, MANIFEST, FORMAT_VERSION, "Medusa heads", "medusa")


def load_heads(directory: Path) -> MedusaHeads:
    manifest = read_heads_manifest(directory)
    return load_head_weights(MedusaHeads(manifest["num_heads"], manifest["hidden_size"]), directory)
