"""SpecDec++'s acceptance-prediction head (Huang et al. 2024): on the draft model's last hidden state
(method specdec++), or on the SS model's stream states (method ss-adaptive, runtime/speculation/tree_choice.py).

Read at a draft token's own position (its state has seen the token), the head predicts the
probability that the target accepts that token, given that every draft before it was accepted.
Drafting stops once the probability of at least one rejection, 1 - prod_i p_i, passes a threshold
h (the paper's Theorem 3.1; methods/sd/drafter.py). The head is the paper's D residual blocks,
h + SiLU(W h + b), then a linear layer to one logit; W starts at zero. The draft model stays frozen.

    <dir>/acceptance.json      format version, depth, hidden size, info (training figures)
    <dir>/heads.safetensors    the weights
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamfuse.head_format import ACCEPTANCE_MANIFEST, ACCEPTANCE_VERSION, read_head_manifest

from .head_files import load_head_weights, residual_blocks, save_head

MANIFEST, FORMAT_VERSION = ACCEPTANCE_MANIFEST, ACCEPTANCE_VERSION


class AcceptanceHead(nn.Module):
    def __init__(self, hidden_size: int, depth: int = 3):
        super().__init__()
        if depth < 0:
            raise ValueError(f"an acceptance head needs depth >= 0 (0: linear), got {depth}")
        self.blocks = residual_blocks(hidden_size, depth)
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final-normed draft states -> [...] logits of acceptance."""
        for block in self.blocks:
            hidden = hidden + nn.functional.silu(block(hidden))
        return self.out(hidden).squeeze(-1)


def save_acceptance_head(head: AcceptanceHead, directory: Path, info: dict) -> None:
    save_head(
        head,
        directory,
        MANIFEST,
        {
            "format_version": FORMAT_VERSION,
            "depth": len(head.blocks),
            "hidden_size": head.out.in_features,
            "info": info,
        },
    )


def read_acceptance_manifest(directory: Path, option: str = "specdec") -> dict:
    """option: the build's config section that makes the head (specdec, adaptive), for the error's fix."""
    return read_head_manifest(directory, MANIFEST, FORMAT_VERSION, "acceptance head", option)


def load_acceptance_head(directory: Path, option: str = "specdec") -> AcceptanceHead:
    manifest = read_acceptance_manifest(directory, option)
    return load_head_weights(AcceptanceHead(manifest["hidden_size"], manifest["depth"]), directory)
