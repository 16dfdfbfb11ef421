"""Speculative stream initialisation at layer N - N_s (paper eq. 3 and appendix B)."""

from __future__ import annotations

import torch
from torch import nn

from .config import StreamConfig


class StreamInit(nn.Module):
    """S_j = f_eta(M) + P_j for j = 1..gamma.

    f_eta is identity (init_rank 0, the paper's choice) or a zero-initialised residual low-rank
    map. P_j are the stream-identifier embeddings; with value-rotation streams they are absent
    and streams start as copies of the main stream.
    """

    def __init__(self, config: StreamConfig, hidden_size: int):
        super().__init__()
        self.num_streams = config.num_streams
        self.identifiers = None
        if config.stream_init == "embedding":
            self.identifiers = nn.Parameter(torch.randn(config.num_streams, hidden_size) * 0.02)
        self.down = self.up = None
        if config.init_rank > 0:
            self.down = nn.Linear(hidden_size, config.init_rank, bias=False)
            self.up = nn.Linear(config.init_rank, hidden_size, bias=False)
            nn.init.zeros_(self.up.weight)

    def forward(self, anchor_hidden: torch.Tensor) -> torch.Tensor:
        """anchor_hidden [B, A, H] main-stream states of the anchor tokens -> [B, A, gamma, H]."""
        hidden = anchor_hidden
        if self.down is not None:
            hidden = hidden + self.up(self.down(hidden))
        streams = hidden[:, :, None, :].expand(-1, -1, self.num_streams, -1)
        if self.identifiers is not None:
            streams = streams + self.identifiers
        return streams
