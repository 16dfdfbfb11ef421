"""The target distribution: greedy, or temperature with top-k / top-p filtering; and the draws.

Plain and speculative decoding both draw from `target_probs`, so "lossless" has one meaning.
Arrays are numpy's: the host side of every backend is the same code, torch or no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


def target_probs(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """[..., V] logits -> [..., V] float32 probabilities of the (filtered, tempered) target."""
    logits = np.asarray(logits, dtype=np.float32) / np.float32(config.temperature)
    if config.top_k:
        k = min(config.top_k, logits.shape[-1])
        kth = np.partition(logits, logits.shape[-1] - k, axis=-1)[..., -k : -k + 1 or None]
        logits = np.where(logits < kth, np.float32(-np.inf), logits)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        ranked[np.cumsum(ranked, axis=-1) - ranked >= config.top_p] = 0.0
        probs = np.zeros_like(probs)
        np.put_along_axis(probs, order, ranked, axis=-1)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def draw(weights: np.ndarray, generator: np.random.Generator) -> int:
    """One index drawn with probability proportional to `weights` [V] (>= 0, not all zero): the
    inverse of the cumulative sum at one uniform draw, so a zero weight is never drawn."""
    cumulative = np.cumsum(weights, dtype=np.float64)
    index = int(np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right"))
    return min(index, len(cumulative) - 1)


def choose(logits: np.ndarray, config: SamplingConfig, generator: np.random.Generator | None) -> int:
    """One token from [V] logits: argmax when greedy, else a draw from the target."""
    if config.greedy:
        return int(np.argmax(logits))
    return draw(target_probs(logits, config), generator)


def ranked(scores: np.ndarray, width: int) -> np.ndarray:
    """[..., V] scores -> [..., width] int64 indices of the highest, best first (ties: lower index first)."""
    scores = np.asarray(scores)
    width = min(width, scores.shape[-1])
    top = np.argpartition(-scores, width - 1, axis=-1)[..., :width]
    values = np.take_along_axis(scores, top, axis=-1)
    order = np.lexsort((top, -values), axis=-1)
    return np.take_along_axis(top, order, axis=-1).astype(np.int64)
