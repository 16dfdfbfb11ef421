"""ParallelSpec's drafter (Xiao et al. 2024), Medusa variant: one decoder layer shaped like the base's drafts
k + 1 tokens in one pass from the target's last hidden state.

    real row p:      fuse([h_p ; e(x_{p+1})])   h_p: the target's final-normed state after x_p
    [MASK]_j row:    a learned input, j = 1..k, after the last real row t, at position t + j
    one layer, the final norm, the target's (pruned) LM head: row t -> x_{t+2}, [MASK]_j -> x_{t+2+j}

The root x_{t+1} is the target's own token, so one pass drafts depths 1..k+1 of a tree: depth 1 from the
last real row, depth 1 + j from [MASK]_j. [MASK]_j sees the real rows up to t and [MASK]_1..j, never a
drafted token, so each depth is a marginal and its top-k fill a static tree (runtime/parallel_drafter.py).
The drafter's own KV cache keeps real rows only (mask rows are dropped after the pass) and starts at the
prompt's last position: the target's states already carry the prompt, so the drafter costs nothing at
prefill and its calls do not grow with the prompt.

    <dir>/parallelspec.json     format version, masks, hidden size, the kept vocabulary's size, info
    <dir>/heads.safetensors     fuse, layer, norm, mask inputs, the head's kept rows and their token ids
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamfuse.head_format import read_head_manifest

from .fused_drafter import FusedDrafter, fresh_parts
from .head_files import load_head_weights, save_head
from .msa import StepKeyValues

MANIFEST = "parallelspec.json"
FORMAT_VERSION = 1


class ParallelSpecModel(FusedDrafter):
    def __init__(self, layer: nn.Module, norm: nn.Module, rotary: nn.Module, head_rows: torch.Tensor,
                 vocab_ids: torch.Tensor, masks: int):
        super().__init__(layer, norm, rotary, head_rows, vocab_ids)
        if masks < 1:
            raise ValueError(f"ParallelSpec needs >= 1 [MASK] input, got {masks}")
        self.mask_inputs = nn.Parameter(torch.randn(masks, head_rows.shape[1]) * 0.02)

    @property
    def num_masks(self) -> int:
        return len(self.mask_inputs)

    def forward(self, states: torch.Tensor, embeds: torch.Tensor, masks: int, positions: torch.Tensor,
                mask: torch.Tensor, key_values: StepKeyValues) -> torch.Tensor:
        """states, embeds [B, R, H] the target's states and the next tokens' embeddings of R real rows, then
        `masks` mask rows; positions [B, R + masks]; mask [B, 1, R + masks, P + R + masks] additive over (past,
        this call); key_values: the past, and where the real rows' K/V go (main_len R).
        -> [B, R + masks, D] logits over the kept vocabulary."""
        return self.run(self.inputs(states, embeds, masks), positions, mask, key_values)

    def inputs(self, states: torch.Tensor, embeds: torch.Tensor, masks: int) -> torch.Tensor:
        """[B, R, H] states and next-token embeddings -> [B, R + masks, H] the layer's input rows."""
        real = self.fused(states, embeds)
        return torch.cat([real, self.mask_inputs[:masks].expand(real.shape[0], masks, -1).to(real.dtype)], dim=1)


def save_drafter(drafter: ParallelSpecModel, directory: Path, info: dict) -> None:
    """Write the drafter and its manifest (last: a folder with one is complete)."""
    save_head(drafter, directory, MANIFEST, {"format_version": FORMAT_VERSION, "masks": drafter.num_masks,
                                             "hidden_size": drafter.hidden_size,
                                             "vocab": len(drafter.vocab_ids), "info": info})


def read_drafter_manifest(directory: Path) -> dict:
    return read_head_manifest(directory, MANIFEST, FORMAT_VERSION, "ParallelSpec drafter", "parallelspec")


def load_drafter(directory: Path, model: nn.Module) -> ParallelSpecModel:
    """The drafter in `directory` for `model` (the HF causal LM it was trained on, or one of its shape)."""
    manifest = read_drafter_manifest(directory)
    vocab, hidden = manifest["vocab"], manifest["hidden_size"]
    drafter = ParallelSpecModel(*fresh_parts(model), torch.zeros(vocab, hidden), torch.arange(vocab), manifest["masks"])
    return load_head_weights(drafter, directory)
