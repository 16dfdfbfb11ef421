"""ParallelSpec's drafter (Xiao et al. 2024), Medusa variant: one decoder layer shaped like the base's drafts
k + 1 tokens in one pass from the target's last hidden state.

    real row p:      fuse([h_p ; e(x_{p+1})])   h_p: the target's final-normed state after x_p
    [MASK]_j row:    a learned input, j = 1..k, after the last real row t, at position t + j
    one layer, the final norm, the target's (pruned) LM head: row t -> x_{t+2}, [MASK]_j -> x_{t+2+j}

The root x_{t+1} is the target's own token, so one pass drafts depths 1..k+1 of a tree: depth 1 from the
last real row, depth 1 + j from [MASK]_j. [MASK]_j sees the real rows up to t and [MASK]_1..j, never a
drafted token, so each depth is a marginal and its top-k fill a static tree (its drafter, beside this file).
The drafter's own KV cache keeps real rows only (mask rows are dropped after the pass) and starts at the
prompt's last position: the target's states already carry the prompt, so the drafter costs nothing at
prefill and its calls do not grow with the prompt.

    <dir>/parallelspec.json     format version, masks, hidden size, the kept vocabulary's size, info
    <dir>/heads.safetensors     fuse, layer, norm, mask inputs, the head's kept rows and their token ids
"""

from __future__ import annotations

import torch
from torch import nn

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.fused.model import DrafterFiles, FusedDrafter

MANIFEST = "parallelspec.json"
FORMAT_VERSION = 1


class ParallelSpecModel(FusedDrafter):
    """size: masks, its [MASK] inputs."""

    SIZE_ERROR = "ParallelSpec needs >= 1 [MASK] input, got {}"

    def own(self, masks: int) -> None:
        self.mask_inputs = nn.Parameter(torch.randn(masks, self.hidden_size) * 0.02)

    @property
    def num_masks(self) -> int:
        return len(self.mask_inputs)

    def forward(
        self,
        states: torch.Tensor,
        embeds: torch.Tensor,
        masks: int,
        positions: torch.Tensor,
        mask: torch.Tensor,
        key_values: StepKeyValues,
    ) -> torch.Tensor:
        """states, embeds [B, R, H] the target's states and the next tokens' embeddings of R real rows, then
        `masks` mask rows; positions [B, R + masks]; mask [B, 1, R + masks, P + R + masks] additive over (past,
        this call); key_values: the past, and where the real rows' K/V go (main_len R).
        -> [B, R + masks, D] logits over the kept vocabulary."""
        return self.run(self.inputs(states, embeds, masks), positions, mask, key_values)

    def inputs(self, states: torch.Tensor, embeds: torch.Tensor, masks: int) -> torch.Tensor:
        """[B, R, H] states and next-token embeddings -> [B, R + masks, H] the layer's input rows."""
        real = self.fused(states, embeds)
        return torch.cat([real, self.mask_inputs[:masks].expand(real.shape[0], masks, -1).to(real.dtype)], dim=1)


FILES = DrafterFiles(
    ParallelSpecModel, MANIFEST, FORMAT_VERSION, "ParallelSpec drafter", "parallelspec", "masks", "num_masks"
)
save_drafter, read_drafter_manifest, load_drafter = FILES.save, FILES.read_manifest, FILES.load
