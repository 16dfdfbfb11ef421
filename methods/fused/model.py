"""The one-layer drafter ParallelSpec and Falcon share: it reads the target's final-normed state and the next
token's embedding at each position, fused into one row (EAGLE's input), through one decoder layer shaped like
the base's, the final norm and the target's LM head cut to a kept vocabulary.

    row p:  fuse([h_p ; e(x_{p+1})])   h_p: the target's final-normed state after x_p
    layer, norm -> a final-normed state (Falcon feeds it back as the next h), head -> logits over vocab_ids

A one-layer drafter's K/V at a row depend on that row's input and position alone, whatever it attends to: its
cache of real rows is the same under any mask, which both methods' passes rely on.

On disk (each method names its manifest and its own fields):

    <dir>/<method>.json         format version, hidden size, the kept vocabulary's size, the method's fields, info
    <dir>/heads.safetensors     fuse, layer, norm, the method's own inputs, the head's kept rows and their token ids
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from streamfuse.adapters import hf
from streamfuse.adapters.head_files import load_head_weights, save_head
from streamfuse.adapters.model import kept_rows
from streamfuse.adapters.msa import StepKeyValues
from streamfuse.head_format import read_head_manifest


class FusedDrafter(nn.Module):
    """size: the kind's own count (ParallelSpec's [MASK] inputs, Falcon's block), >= 1, given to `own` (SIZE_ERROR
    says what it counts when it is not)."""

    SIZE_ERROR = "a fused drafter's size must be >= 1, got {}"

    def __init__(
        self,
        layer: nn.Module,
        norm: nn.Module,
        rotary: nn.Module,
        head_rows: torch.Tensor,
        vocab_ids: torch.Tensor,
        size: int,
    ):
        super().__init__()
        hidden = head_rows.shape[1]
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer, self.norm, self.rotary = layer, norm, rotary
        self.head = nn.Linear(hidden, len(vocab_ids), bias=False)
        self.head.weight = nn.Parameter(head_rows.detach().clone(), requires_grad=False)
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())
        if size < 1:
            raise ValueError(self.SIZE_ERROR.format(size))
        self.own(size)

    def own(self, size: int) -> None:
        """The kind's own parameters or settings."""

    @classmethod
    def like(cls, model: nn.Module, vocab_ids: torch.Tensor, size: int) -> FusedDrafter:
        """A drafter for `model` (an HF causal LM): its layer a copy of the model's last, the final norm a copy,
        the head the LM head's rows of `vocab_ids` (ascending token ids); size: the kind's own count."""
        parts = hf.decoder_parts(model)
        ids, rows = kept_rows(parts.lm_head.weight, vocab_ids)
        layer, norm, rotary = fresh_parts(model)
        layer.load_state_dict(parts.layers[-1].state_dict())
        norm.load_state_dict(parts.norm.state_dict())
        drafter = cls(layer, norm, rotary, rows, ids, size)
        drafter.start_fused(1.0)
        return drafter

    def start_fused(self, embed_scale: float) -> None:
        """fuse([h; e]) = h + embed_scale * e: the layer first sees the target's state plus the next token, at a
        scale that makes the token heard (final-normed states are far larger than embeddings)."""
        hidden = self.fuse.out_features
        with torch.no_grad():
            self.fuse.weight.copy_(torch.cat([torch.eye(hidden), embed_scale * torch.eye(hidden)], dim=1))

    @property
    def hidden_size(self) -> int:
        return self.head.in_features

    def fused(self, states: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[B, R, H] states and next-token embeddings -> [B, R, H] the layer's input rows."""
        return self.fuse(torch.cat([states, embeds], dim=-1))

    def run(
        self, rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, key_values: StepKeyValues
    ) -> torch.Tensor:
        """The layer, norm and head over input rows [B, N, H]."""
        return self.head(self.states(rows, positions, mask, key_values))

    def states(
        self, rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, key_values: StepKeyValues
    ) -> torch.Tensor:
        """The layer and the final norm over input rows [B, N, H] at positions [B, N]; mask [B, 1, N, P + N]
        additive over (past, these rows) -> [B, N, H] final-normed states."""
        rope = self.rotary(rows, positions)
        return self.norm(hf.call_layer(self.layer, rows, mask, rope, key_values))


def fresh_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """A new float layer, final norm (the layer's norm class: a packed model's may be swapped) and rotary
    embedding of the model's shape."""
    layer = hf.fresh_decoder_layer(model)
    return layer, copy.deepcopy(layer.post_attention_layernorm), copy.deepcopy(hf.decoder_parts(model).rotary)


@dataclass(frozen=True)
class DrafterFiles:
    """How a fused drafter kind is stored: its manifest file and format version, what the errors call it, the build's
    config section that makes it, and its own manifest field (its constructor's last argument)."""

    kind: type[FusedDrafter]
    manifest: str
    version: int
    what: str
    section: str
    field: str  # the manifest field the kind's last constructor argument is read from
    value: str  # the drafter's attribute that holds it

    def save(self, drafter: FusedDrafter, directory: Path, info: dict) -> None:
        """Write the drafter and its manifest (last: a folder with one is complete)."""
        save_head(
            drafter,
            directory,
            self.manifest,
            {
                "format_version": self.version,
                self.field: getattr(drafter, self.value),
                "hidden_size": drafter.hidden_size,
                "vocab": len(drafter.vocab_ids),
                "info": info,
            },
        )

    def read_manifest(self, directory: Path) -> dict:
        return read_head_manifest(directory, self.manifest, self.version, self.what, self.section)

    def load(self, directory: Path, model: nn.Module) -> FusedDrafter:
        """The drafter in `directory` for `model` (the HF causal LM it was trained on, or one of its shape)."""
        manifest = self.read_manifest(directory)
        vocab, hidden = manifest["vocab"], manifest["hidden_size"]
        drafter = self.kind(*fresh_parts(model), torch.zeros(vocab, hidden), torch.arange(vocab), manifest[self.field])
        return load_head_weights(drafter, directory)
