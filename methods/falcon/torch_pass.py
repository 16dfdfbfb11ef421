"""Falcon's drafter pass in torch (methods/falcon/drafter.py's FalconPass): the drafter module
(methods/falcon/model.py) over the target model's own embedding, its cache a tensor cut back to each pass's
first slot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.falcon.drafter import block_visibility
from streamfuse.methods.falcon.model import FalconModel, load_drafter
from streamfuse.methods.fused.torch_pass import TorchDrafterPass


class TorchFalconPass(TorchDrafterPass):
    def __init__(self, drafter: FalconModel, *args, **kwargs):
        super().__init__(drafter, *args, **kwargs)
        self.block = drafter.block

    @torch.inference_mode()
    def run(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        rows = len(tokens)
        past = None if slot == 0 else [(self.keys[:, :, :slot], self.values[:, :, :slot])]
        hidden, embeds, positions, mask = self.inputs(
            states, tokens, position, rows, block_visibility(slot, slot, rows, rows, self.block)
        )
        cache = StepKeyValues(1, rows, past)
        features, logits = self.drafter(hidden, embeds, positions, mask, cache)
        self.append(cache.new[0], slot)
        read = slice(rows - self.block, None)
        return features[0, read].float().cpu().numpy(), logits[0, read].float().cpu().numpy()


def open_pass(backend, folder: Path) -> TorchFalconPass:
    """The artifact's drafter in `folder` on a torch target's backend."""
    return TorchFalconPass.over(backend, load_drafter(folder, backend.model.model))
