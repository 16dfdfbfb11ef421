"""Falcon's drafter (Gao et al. 2024), semi-autoregressive: the one-layer fused drafter (adapters/fused_drafter.py)
reads k rows at a time and predicts the state k positions ahead of each, so one pass drafts k tokens and the
predicted states with their top tokens feed the next pass.

    row p:   fuse([h_p ; e(x_{p+1})]) -> ĥ_{p+k}, head -> x_{p+k+1}
    pass 1:  the last k real rows (h_{t-k+1..t}, x_{t-k+2..t+1}), x_{t+1} the root -> depths 1..k
    pass b:  the previous pass's rows (ĥ, its top tokens) -> depths (b-1)k+1..bk

Every row of a pass's block sees the others (the relaxed causal mask) and what came before it. The paper's
drafter is an LSTM, attention and an MLP ("about two layers"); this one is one decoder layer of the base's
shape, which exports as the other graphs do.

    <dir>/falcon.json           format version, block k, hidden size, the kept vocabulary's size, info
    <dir>/heads.safetensors     fuse, layer, norm, the head's kept rows and their token ids
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamfuse.head_format import read_head_manifest

from .fused_drafter import FusedDrafter, fresh_parts
from .head_files import load_head_weights, save_head
from .msa import StepKeyValues

MANIFEST = "falcon.json"
FORMAT_VERSION = 1


class FalconModel(FusedDrafter):
    def __init__(self, layer: nn.Module, norm: nn.Module, rotary: nn.Module, head_rows: torch.Tensor,
                 vocab_ids: torch.Tensor, block: int):
        super().__init__(layer, norm, rotary, head_rows, vocab_ids)
        if block < 1:
            raise ValueError(f"Falcon drafts k >= 1 tokens a pass, got k = {block}")
        self.block = block

    def forward(self, states: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                key_values: StepKeyValues) -> tuple[torch.Tensor, torch.Tensor]:
        """states, embeds [B, N, H] (a real or predicted state, the token after it) at positions [B, N]; mask
        [B, 1, N, P + N] additive over (past, these rows) -> (predicted states [B, N, H] k positions ahead,
        their logits [B, N, D] over the kept vocabulary)."""
        predicted = self.states(self.fused(states, embeds), positions, mask, key_values)
        return predicted, self.head(predicted)


def save_drafter(drafter: FalconModel, directory: Path, info: dict) -> None:
    """Write the drafter and its manifest (last: a folder with one is complete)."""
    save_head(drafter, directory, MANIFEST, {"format_version": FORMAT_VERSION, "block": drafter.block,
                                             "hidden_size": drafter.hidden_size, "vocab": len(drafter.vocab_ids),
                                             "info": info})


def read_drafter_manifest(directory: Path) -> dict:
    return read_head_manifest(directory, MANIFEST, FORMAT_VERSION, "Falcon drafter", "falcon")


def load_drafter(directory: Path, model: nn.Module) -> FalconModel:
    """The drafter in `directory` for `model` (the HF causal LM it was trained on, or one of its shape)."""
    manifest = read_drafter_manifest(directory)
    vocab, hidden = manifest["vocab"], manifest["hidden_size"]
    drafter = FalconModel(*fresh_parts(model), torch.zeros(vocab, hidden), torch.arange(vocab), manifest["block"])
    return load_head_weights(drafter, directory)
