"""Falcon's drafter pass in torch (runtime/falcon_drafter.py's FalconPass): the drafter module (adapters/falcon.py)
over the target model's own embedding, its cache a tensor cut back to each pass's first slot."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from streamfuse.adapters.falcon import FalconModel
from streamfuse.adapters.msa import StepKeyValues
from streamfuse.runtime.backends.parallel_torch import TorchDrafterPass
from streamfuse.runtime.falcon_drafter import block_visibility


class TorchFalconPass(TorchDrafterPass):
    def __init__(self, drafter: FalconModel, *args, **kwargs):
        super().__init__(drafter, *args, **kwargs)
        self.block = drafter.block

    @torch.inference_mode()
    def run(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        rows = len(tokens)
        past = None if slot == 0 else [(self.keys[:, :, :slot], self.values[:, :, :slot])]
        hidden = torch.as_tensor(np.asarray(states), device=self.device).to(self.dtype)[None]
        embeds = self.embed(torch.tensor([list(tokens)], device=self.device)).to(self.dtype)
        positions = torch.arange(position, position + rows, device=self.device)[None]
        visible = torch.as_tensor(block_visibility(slot, slot, rows, rows, self.block), device=self.device)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]
        cache = StepKeyValues(1, rows, past)
        features, logits = self.drafter(hidden, embeds, positions, mask, cache)
        keys, values = cache.new[0]
        self.keys = keys if past is None else torch.cat([past[0][0], keys], dim=2)
        self.values = values if past is None else torch.cat([past[0][1], values], dim=2)
        read = slice(rows - self.block, None)
        return features[0, read].float().cpu().numpy(), logits[0, read].float().cpu().numpy()
