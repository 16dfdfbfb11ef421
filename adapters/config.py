"""Typed configuration of the Speculative Streaming additions to a base causal LM."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

StreamInit = Literal["embedding", "value_rotation"]


@dataclass(frozen=True)
class StreamConfig:
    """Multi-stream attention (paper 3.2.1), stream initialisation (eq. 3) and pruning head (3.2.3).

    num_streams: gamma, the number of speculative streams; stream j predicts the token j
        positions after the main stream's next token.
    msa_layers: N_s, the number of top decoder layers that get multi-stream attention.
    stream_init: "embedding" adds a learned stream-identifier embedding P_j (eq. 3);
        "value_rotation" (appendix B) starts streams as copies of the main stream and rotates
        stream j's value projections by j * rotation_step radians instead.
    init_rank: rank eta of f_eta in eq. 3; 0 means identity (the paper's choice).
    init_per_stream: one f_eta per stream (a residual low-rank SiLU block each) instead of one
        shared linear map; needs init_rank > 0.
    rotation_step: epsilon of eq. 7; None picks pi / (2 * (max_positions + gamma)).
    pruning_rank: rank of the early-exit adapter o_theta of the tree-pruning head.
    pruning_layer: main-stream layer whose output feeds the pruning head; None means
        N - N_s, just before stream insertion (the paper's choice).
    """

    num_streams: int = 3
    msa_layers: int = 4
    stream_init: StreamInit = "embedding"
    init_rank: int = 0
    init_per_stream: bool = False
    rotation_step: float | None = None
    pruning_rank: int = 8
    pruning_layer: int | None = None

    def validate(self, num_layers: int) -> None:
        """Raise ValueError when this config cannot be applied to a model with num_layers."""
        if self.num_streams < 1:
            raise ValueError(f"num_streams (gamma) must be >= 1, got {self.num_streams}")
        if not 1 <= self.msa_layers < num_layers:
            raise ValueError(
                f"msa_layers (N_s) must be in [1, {num_layers - 1}] for a {num_layers}-layer "
                f"model, got {self.msa_layers}"
            )
        if self.stream_init not in ("embedding", "value_rotation"):
            raise ValueError(f"stream_init must be 'embedding' or 'value_rotation', got {self.stream_init!r}")
        if self.init_rank < 0 or self.pruning_rank < 1:
            raise ValueError("init_rank must be >= 0 and pruning_rank >= 1")
        if self.init_per_stream and self.init_rank == 0:
            raise ValueError("init_per_stream needs init_rank > 0 (the rank of each stream's f_eta)")
        layer = self.pruning_layer_index(num_layers)
        # The runtime prunes the tree before streams are inserted, so the head must read below them.
        if not 1 <= layer <= self.first_msa_layer(num_layers):
            raise ValueError(f"pruning_layer must be in [1, N - N_s = {self.first_msa_layer(num_layers)}], got {layer}")

    def first_msa_layer(self, num_layers: int) -> int:
        """Index of the first decoder layer with multi-stream attention (N - N_s)."""
        return num_layers - self.msa_layers

    def pruning_layer_index(self, num_layers: int) -> int:
        """Number of decoder layers the main stream passes before the pruning head reads it."""
        return self.first_msa_layer(num_layers) if self.pruning_layer is None else self.pruning_layer

    def value_rotation_step(self, max_positions: int) -> float:
        if self.rotation_step is not None:
            return self.rotation_step
        return math.pi / (2 * (max_positions + self.num_streams))

    @classmethod
    def from_dict(cls, data: dict) -> StreamConfig:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown StreamConfig fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA shared by the main stream and the streams (the paper uses rank 32).

    top_layers: apply LoRA only to the top this-many decoder layers (None = all). On a CPU this
        is the main lever on training time: backward stops at the lowest adapted layer.
    """

    rank: int = 32
    alpha: float = 64.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    top_layers: int | None = None

    def validate(self, num_layers: int) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.top_layers is not None and not 1 <= self.top_layers <= num_layers:
            raise ValueError(f"lora top_layers must be in [1, {num_layers}], got {self.top_layers}")

    def layers(self, num_layers: int) -> list[int] | None:
        if self.top_layers is None:
            return None
        return list(range(num_layers - self.top_layers, num_layers))
