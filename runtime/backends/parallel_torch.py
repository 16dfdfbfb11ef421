"""ParallelSpec's drafter pass in torch (runtime/parallel_drafter.py's ParallelPass): the drafter module
(adapters/parallelspec.py) over the target model's own embedding, its cache a growing tensor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.adapters.parallelspec import ParallelSpecModel
from streamfuse.runtime.parallel_drafter import pass_visibility


class TorchDrafterPass:
    """A fused drafter (adapters/fused_drafter.py) in torch over the target's embedding, its K/V cache tensors."""

    def __init__(self, drafter, embed: torch.nn.Module, vocab_size: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.drafter = drafter.to(device, dtype).eval().requires_grad_(False)
        self.embed, self.device, self.dtype, self.vocab_size = embed, device, dtype, vocab_size
        self.vocab_ids = drafter.vocab_ids.cpu().numpy()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def reset(self) -> None:
        self.keys = self.values = None


class TorchParallelPass(TorchDrafterPass):
    def __init__(self, drafter: ParallelSpecModel, *args, **kwargs):
        super().__init__(drafter, *args, **kwargs)
        self.masks = drafter.num_masks

    @torch.inference_mode()
    def run(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        real, past = len(tokens), 0 if self.keys is None else self.keys.shape[2]
        hidden = torch.as_tensor(states, device=self.device).to(self.dtype)[None]
        embeds = self.embed(torch.tensor([list(tokens)], device=self.device)).to(self.dtype)
        positions = torch.arange(position, position + real + self.masks, device=self.device)[None]
        visible = torch.as_tensor(pass_visibility(past, past, real, real, self.masks), device=self.device)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]
        cache = StepKeyValues(1, real, None if self.keys is None else [(self.keys, self.values)])
        logits = self.drafter(hidden, embeds, self.masks, positions, mask, cache)[0, real - 1 :]
        keys, values = cache.new[0]
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)
        return logits.float().cpu().numpy()
