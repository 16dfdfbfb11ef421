"""A fused drafter's pass in torch (methods/fused/model.py's module) over the target model's own embedding, its
K/V cache tensors: what Falcon's and ParallelSpec's torch passes share. Runtime files reach it through
registry.part(name, "torch_pass"), never by an import."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class TorchDrafterPass:
    def __init__(
        self, drafter, embed: torch.nn.Module, vocab_size: int, device: str = "cpu", dtype: torch.dtype = torch.float32
    ):
        self.drafter = drafter.to(device, dtype).eval().requires_grad_(False)
        self.embed, self.device, self.dtype, self.vocab_size = embed, device, dtype, vocab_size
        self.vocab_ids = drafter.vocab_ids.cpu().numpy()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @classmethod
    def over(cls, backend, drafter) -> TorchDrafterPass:
        """The pass of `drafter` (loaded for backend.model's shape) on a torch target's backend."""
        model = backend.model
        return cls(drafter, model.parts.embed, model.parts.vocab_size, backend.device, backend.dtype)

    def reset(self) -> None:
        self.keys = self.values = None

    def inputs(
        self, states: np.ndarray, tokens: Sequence[int], position: int, rows: int, visible: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(states [1, R, H], their tokens' embeddings [1, R, H], positions [1, rows] from `position`, the additive
        mask [1, 1, rows, P + rows] of `visible`)."""
        hidden = torch.as_tensor(np.asarray(states), device=self.device).to(self.dtype)[None]
        embeds = self.embed(torch.tensor([list(tokens)], device=self.device)).to(self.dtype)
        positions = torch.arange(position, position + rows, device=self.device)[None]
        visible = torch.as_tensor(visible, device=self.device)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        return hidden, embeds, positions, mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]

    def append(self, new: tuple[torch.Tensor, torch.Tensor], past: int) -> None:
        """The cache's first `past` slots, then the call's K/V."""
        keys, values = new
        self.keys = keys if past == 0 else torch.cat([self.keys[:, :, :past], keys], dim=2)
        self.values = values if past == 0 else torch.cat([self.values[:, :, :past], values], dim=2)
