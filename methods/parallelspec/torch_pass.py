"""ParallelSpec's drafter pass in torch (methods/parallelspec/drafter.py's ParallelPass): the drafter module
(methods/parallelspec/model.py) over the target model's own embedding, its cache a growing tensor."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.fused.torch_pass import TorchDrafterPass
from streamfuse.methods.parallelspec.drafter import pass_visibility
from streamfuse.methods.parallelspec.model import ParallelSpecModel, load_drafter


class TorchParallelPass(TorchDrafterPass):
    def __init__(self, drafter: ParallelSpecModel, *args, **kwargs):
        super().__init__(drafter, *args, **kwargs)
        self.masks = drafter.num_masks

    @torch.inference_mode()
    def run(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        real, past = len(tokens), 0 if self.keys is None else self.keys.shape[2]
        visible = pass_visibility(past, past, real, real, self.masks)
        hidden, embeds, positions, mask = self.inputs(states, tokens, position, real + self.masks, visible)
        cache = StepKeyValues(1, real, None if self.keys is None else [(self.keys, self.values)])
        logits = self.drafter(hidden, embeds, self.masks, positions, mask, cache)[0, real - 1 :]
        self.append(cache.new[0], past)
        return logits.float().cpu().numpy()


def open_pass(backend, folder: Path) -> TorchParallelPass:
    """The artifact's drafter in `folder` on a torch target's backend."""
    return TorchParallelPass.over(backend, load_drafter(folder, backend.model.model))
