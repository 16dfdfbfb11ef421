"""Medusa heads (Cai et al. 2024), the SS paper's first baseline: drafts from the target's last hidden state.

Head j is a residual block, h + SiLU(W_j h + b_j), read through the target's shared LM head; it
predicts the token j positions after the next one, as stream j does, so its top-k fill the same
static trees (runtime/stream_drafter.py). W_j starts at zero, so a new head is the identity and
drafts the next token itself. The target stays frozen (Medusa-1): the heads train on its
final-normed states over its own greedy answers (export/training/medusa.py).

    <dir>/medusa.json          format version, number of heads, hidden size, info
    <dir>/heads.safetensors    the blocks' weights
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

MANIFEST = "medusa.json"
FORMAT_VERSION = 1


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"Medusa needs >= 1 head, got {num_heads}")
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final-normed target states -> [..., heads, H], for the shared LM head."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks], dim=-2)


def save_heads(heads: MedusaHeads, directory: Path, info: dict) -> None:
    """Write the heads and their manifest; the manifest goes last, so a folder with one is complete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, str(directory / "heads.safetensors"))
    manifest = {"format_version": FORMAT_VERSION, "num_heads": heads.num_heads,
                "hidden_size": heads.blocks[0].in_features, "info": info}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def read_heads_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} holds no Medusa heads (export/build.py "
                                f"--set medusa.enabled=true makes them)")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {manifest.get('format_version')}, this streamfuse reads "
                         f"{FORMAT_VERSION}: rebuild the heads")
    return manifest


def load_heads(directory: Path) -> MedusaHeads:
    manifest = read_heads_manifest(directory)
    heads = MedusaHeads(manifest["num_heads"], manifest["hidden_size"])
    heads.load_state_dict(load_file(str(Path(directory) / "heads.safetensors")))
    return heads.eval()
