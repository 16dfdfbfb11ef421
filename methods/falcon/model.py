"""Falcon's drafter (Gao et al. 2024), semi-autoregressive: the one-layer fused drafter (methods/fused/model.py)
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

import torch

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.fused.model import DrafterFiles, FusedDrafter

MANIFEST = "falcon.json"
FORMAT_VERSION = 1


class FalconModel(FusedDrafter):
    """size: block, the k depths a pass drafts."""

    SIZE_ERROR = "Falcon drafts k >= 1 tokens a pass, got k = {}"

    def own(self, block: int) -> None:
        self.block = block

    def forward(
        self,
        states: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        key_values: StepKeyValues,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """states, embeds [B, N, H] (a real or predicted state, the token after it) at positions [B, N]; mask
        [B, 1, N, P + N] additive over (past, these rows) -> (predicted states [B, N, H] k positions ahead,
        their logits [B, N, D] over the kept vocabulary)."""
        predicted = self.states(self.fused(states, embeds), positions, mask, key_values)
        return predicted, self.head(predicted)


FILES = DrafterFiles(FalconModel, MANIFEST, FORMAT_VERSION, "Falcon drafter", "falcon", "block", "block")
save_drafter, read_drafter_manifest, load_drafter = FILES.save, FILES.read_manifest, FILES.load
