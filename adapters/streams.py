"""Speculative stream initialisation at layer N - N_s (paper eq. 3 and appendix B)."""

from __future__ import annotations

import torch
from torch import nn

from .config import StreamConfig


class StreamInit(nn.Module):
    """S_j = f_eta(M) + P_j for j = 1..gamma.

    f_eta is identity (init_rank 0, the paper's choice) or a zero-initialised residual low-rank
    map, shared by the streams; with init_per_stream each stream has its own residual low-rank
    block with a SiLU between (a Medusa head, but before the MSA layers), so streams that the
    shared layers must push different distances ahead start apart. P_j are the stream-identifier
    embeddings; with value-rotation streams they are absent and streams start as copies of the
    main stream. Every f_eta starts as the identity, so adding one to trained streams changes
    nothing until it trains.
    """

    def __init__(self, config: StreamConfig, hidden_size: int):
        super().__init__()
        self.num_streams = config.num_streams
        self.identifiers = None
        if config.stream_init == "embedding":
            self.identifiers = nn.Parameter(torch.randn(config.num_streams, hidden_size) * 0.02)
        self.down = self.up = None
        self.per_stream = config.init_per_stream
        if config.init_rank > 0:
            copies = config.num_streams if self.per_stream else 1
            self.down = nn.Linear(hidden_size, copies * config.init_rank, bias=False)
            self.up = nn.Parameter(torch.zeros(copies, config.init_rank, hidden_size))

    def forward(self, anchor_hidden: torch.Tensor) -> torch.Tensor:
        """anchor_hidden [B, A, H] main-stream states of the anchor tokens -> [B, A, gamma, H]."""
        streams = anchor_hidden[:, :, None, :].expand(-1, -1, self.num_streams, -1)
        if self.down is not None:
            streams = streams + self._low_rank(anchor_hidden)
        if self.identifiers is not None:
            streams = streams + self.identifiers
        return streams

    def _low_rank(self, anchor_hidden: torch.Tensor) -> torch.Tensor:
        """[B, A, H] -> [B, A, gamma or 1, H]: the residual of each f_eta."""
        batch, anchors, size = anchor_hidden.shape
        copies, rank, _ = self.up.shape
        inner = self.down(anchor_hidden).reshape(batch * anchors, copies, rank).transpose(0, 1)
        if self.per_stream:
            inner = nn.functional.silu(inner)
        # A batched matmul [copies, B*A, r] @ [copies, r, H]: plain bmm, which every exporter lowers.
        return torch.matmul(inner, self.up).transpose(0, 1).reshape(batch, anchors, copies, size)
