"""The target distribution: greedy, or temperature with top-k / top-p filtering.

Plain and speculative decoding both draw from `target_probs`, so "lossless" has one meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"invalid sampling settings {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities of the (filtered, tempered) target."""
    logits = logits.float() / config.temperature
    if config.top_k:
        kth = logits.topk(min(config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if config.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= config.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token from [V] logits: argmax when greedy, else a draw from the target."""
    if config.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, config), 1, generator=generator))
