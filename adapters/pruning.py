"""Tree-pruning head (paper 3.2.3): early-exit logits from a middle main-stream layer.

o_theta is a rank-r residual adapter, M + up(down(M)), so at initialisation the head is the
"logit lens" of layer l (final norm + shared LM head) and training only has to correct it. It adds
2 * hidden * r parameters and reuses the LM head, so early-exit logits cost one LM-head product.
"""

from __future__ import annotations

import torch
from torch import nn


class PruningHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.normal_(self.down.weight, std=hidden_size**-0.5)
        nn.init.zeros_(self.up.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] main-stream states at the pruning layer -> adapted states [..., H]
        (the caller applies the final norm and the LM head)."""
        return hidden + self.up(self.down(hidden))
