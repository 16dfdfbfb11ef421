"""The frozen bottom layers' output, computed once per training example and reused.

With LoRA on the top layers only (the cpu presets: top 10 of 30), the first layers' output
for a given example never changes while training. Every later epoch, and every later
training on the same examples in one build (the LoRA baseline after the SS model), starts
from the stored states instead of running those layers again: on the cpu preset that is
two thirds of the forward pass. Results are unchanged: a state is what the same layers
compute on the same row alone, and padding positions are masked out of every later layer.

States are keyed by the bottom layers' weights (a hash) and the row's token ids, so one store
serves every model of a build: those that share the bottom layers share their states.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

from streamfuse.adapters.masks import causal_mask
from streamfuse.adapters.model import BottomState, SpeculativeStreamingLM
from streamfuse.training.data import Batch

DEFAULT_BUDGET_BYTES = 3 * 2**30  # beyond this, rows are computed each time instead of stored


class FrozenStates:
    """(bottom weights, token ids) -> [T, H] hidden states after the frozen layers."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self.stored_bytes = 0
        self._states: dict[tuple[str, bytes], torch.Tensor] = {}
        self._bottoms: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (depth, weights hash)

    def __len__(self) -> int:
        return len(self._states)

    def bottom(self, model: SpeculativeStreamingLM, batch: Batch) -> BottomState | None:
        """The batch's states after the model's frozen layers (None when it has none); rows are
        right-padded with zeros, which no real token attends to."""
        if model not in self._bottoms:
            self._bottoms[model] = _bottom_weights(model)
        depth, weights = self._bottoms[model]
        if depth == 0:
            return None
        lengths = batch.padding.sum(dim=1).tolist()
        rows = [self._row(model, batch.input_ids[b, :n], depth, weights) for b, n in enumerate(lengths)]
        hidden = rows[0].new_zeros(*batch.input_ids.shape, rows[0].shape[-1])
        for b, row in enumerate(rows):
            hidden[b, : row.shape[0]] = row
        return BottomState(depth, hidden)

    def _row(self, model: SpeculativeStreamingLM, ids: torch.Tensor, depth: int, weights: str) -> torch.Tensor:
        key = (weights, ids.cpu().numpy().tobytes())
        if key in self._states:
            return self._states[key]
        with torch.no_grad():
            positions = torch.arange(ids.shape[0], device=ids.device)[None]
            mask = causal_mask(torch.ones_like(ids)[None])  # as forward_batch builds it
            state = model.forward_bottom(ids[None], positions, mask, depth).hidden[0]
        size = state.numel() * state.element_size()
        if self.stored_bytes + size <= self.budget_bytes:
            self._states[key] = state
            self.stored_bytes += size
        return state


def _bottom_weights(model: SpeculativeStreamingLM) -> tuple[int, str]:
    """(frozen depth, hash of the embedding's and those layers' parameters). Read once per model:
    frozen parameters do not change while it trains."""
    depth = model.frozen_depth()
    digest = hashlib.blake2b(str(depth).encode(), digest_size=16)
    modules = [model.parts.embed, *model.parts.layers[:depth]] if depth else []
    for module in modules:
        for name, parameter in module.named_parameters():
            digest.update(name.encode())
            digest.update(parameter.detach().float().cpu().contiguous().numpy().tobytes())
    return depth, digest.hexdigest()
