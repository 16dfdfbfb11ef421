"""Medusa-1 training: heads on the frozen target's own states over its own greedy answers.

One pass of the target (LoRA merged) over each prompt + own answer, teacher-forced, gives the
final-normed state at every answer-predicting position: the features every head trains on, kept
on disk per target model so a rerun or a resumed run does not compute them again. Head j at
position p learns the token at p + 1 + j (stream j's target in runtime/speculation/tree.py's terms), through
the shared, frozen LM head; the loss weighs head j by decay^(j-1), as Medusa does (0.8).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from streamfuse.adapters.masks import causal_mask
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.methods.medusa.model import MedusaHeads
from streamfuse.training.data import Encoded, shuffled_rows
from streamfuse.training.feature_cache import load_features, save_features

IGNORE = -100


@dataclass(frozen=True)
class HeadFeatures:
    hidden: torch.Tensor  # [P, H] the target's final-normed states at answer-predicting positions
    targets: torch.Tensor  # [P, heads] the token head j should give there (IGNORE past the answer's end)


@torch.inference_mode()
def head_features(model: SpeculativeStreamingLM, items: Sequence[Encoded], num_heads: int, cache: Path) -> HeadFeatures:
    """The target's states over every item (cached in `cache`, a safetensors file)."""
    if (stored := load_features(cache)) is not None:
        return HeadFeatures(stored["hidden"], stored["targets"])
    hidden, targets = [], []
    for item in tqdm(items, desc="medusa features", unit="ex", dynamic_ncols=True):
        ids = torch.tensor([item.input_ids])
        out = model(ids, torch.arange(ids.shape[1])[None], causal_mask(torch.ones_like(ids)))
        positions = range(item.prompt_len - 1, len(item.input_ids) - 1)  # each predicts an answer token next
        hidden.append(out.hidden[0, item.prompt_len - 1 : len(item.input_ids) - 1].to(torch.float16))
        targets.append(
            torch.tensor([[_at(item.input_ids, p + 1 + j) for j in range(1, num_heads + 1)] for p in positions])
        )
    features = HeadFeatures(torch.cat(hidden), torch.cat(targets))
    save_features(cache, {"hidden": features.hidden, "targets": features.targets})
    return features


def _at(ids: Sequence[int], index: int) -> int:
    return ids[index] if index < len(ids) else IGNORE


@dataclass(frozen=True)
class HeadTraining:
    epochs: float = 2.0
    learning_rate: float = 1e-3
    batch: int = 256  # positions per step: the frozen LM head over them is most of a step's work
    decay: float = 0.8  # head j's loss weight is decay^(j - 1)
    seed: int = 0


def train_heads(heads: MedusaHeads, lm_head: torch.nn.Module, features: HeadFeatures, config: HeadTraining) -> dict:
    """Train the heads in place (the LM head stays frozen); returns each head's final mean loss and the time."""
    lm_head.requires_grad_(False)
    heads.requires_grad_(True)  # a backend they were attached to froze them
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate, weight_decay=0.0)
    steps = math.ceil(config.epochs * math.ceil(len(features.hidden) / config.batch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    weights = torch.tensor([config.decay**j for j in range(heads.num_heads)])
    batches = shuffled_rows(len(features.hidden), config.batch, config.seed)
    running = torch.zeros(heads.num_heads)
    started = time.perf_counter()
    heads.train()
    for _ in tqdm(range(steps), desc="train medusa", unit="step", dynamic_ncols=True):
        rows = next(batches)
        losses = head_losses(heads, lm_head, features.hidden[rows].float(), features.targets[rows])
        (weights * losses).sum().backward()
        if not any(p.grad is not None and bool(p.grad.any()) for p in heads.parameters()):
            raise ValueError(
                "the heads got no gradient through the LM head (an inference-only kernel, such as "
                "a packed one?): train them through the eager LM head"
            )
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        running = 0.9 * running + 0.1 * losses.detach() if running.any() else losses.detach()
    heads.eval()
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "steps": steps,
        "final_losses": {f"head_{j + 1}": round(float(v), 4) for j, v in enumerate(running)},
    }


def head_losses(
    heads: MedusaHeads, lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """[heads] mean cross-entropy of each head over the rows with a target."""
    states = heads(hidden)  # [B, heads, H]
    losses = []
    for j in range(heads.num_heads):
        keep = targets[:, j] != IGNORE
        losses.append(
            F.cross_entropy(lm_head(states[keep, j]).float(), targets[keep, j]) if keep.any() else states.sum() * 0.0
        )
    return torch.stack(losses)
