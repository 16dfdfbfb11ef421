"""An acceptance head (adapters/acceptance.py) trained on a frozen model's states: the features each method
collects (SpecDec++'s on its draft model, ss-adaptive's on the streams), cached per model, and the training loop
with the paper's weighted BCE: rejections weigh `reject_weight`, acceptances 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from streamfuse.adapters.acceptance import AcceptanceHead, save_acceptance_head
from streamfuse.training.data import Encoded, shuffled_rows
from streamfuse.training.feature_cache import load_features, save_features


@dataclass(frozen=True)
class AcceptanceFeatures:
    hidden: torch.Tensor  # [P, H] the model's state at each drafted token (a draft model's, a stream's)
    accepted: torch.Tensor  # [P] 1.0 where greedy verification accepts that draft token, else 0.0


def collect_features(
    items: Sequence[Encoded], examples: Callable[[Encoded], tuple[torch.Tensor, torch.Tensor]], cache: Path, method: str
) -> AcceptanceFeatures:
    """examples(item) -> ([P, H] states, [P] accepted) over every item whose answer has two tokens or more
    (the first is the target's own, never drafted); cached in `cache`, a safetensors file."""
    if (stored := load_features(cache)) is not None:
        return AcceptanceFeatures(stored["hidden"], stored["accepted"])
    hidden, accepted = [], []
    for item in tqdm(items, desc=f"{method} features", unit="ex", dynamic_ncols=True):
        if len(item.input_ids) - item.prompt_len < 2:
            continue
        states, labels = examples(item)
        hidden.append(states.to(torch.float16))
        accepted.append(labels)
    if not hidden:
        raise ValueError(f"{method}: no own answer of two or more tokens to learn acceptance from")
    features = AcceptanceFeatures(torch.cat(hidden), torch.cat(accepted))
    save_features(cache, {"hidden": features.hidden, "accepted": features.accepted})
    return features


@dataclass(frozen=True)
class AcceptanceTraining:
    epochs: float = 3.0
    learning_rate: float = 1e-3
    batch: int = 512
    reject_weight: float = 6.0  # SpecDec++'s w_rej (w_acc = 1): it pays to stop before a likely rejection
    seed: int = 0


def weighted_bce(logits: torch.Tensor, accepted: torch.Tensor, reject_weight: float) -> torch.Tensor:
    weights = torch.where(accepted > 0.5, 1.0, reject_weight)
    return F.binary_cross_entropy_with_logits(logits, accepted, weight=weights)


def train_acceptance(
    head: AcceptanceHead, features: AcceptanceFeatures, config: AcceptanceTraining, desc: str = "train acceptance head"
) -> dict:
    """Train the head in place; returns its final loss, the acceptance rate and how well the head
    separates the examples (mean predicted probability over accepted and over rejected drafts)."""
    head.requires_grad_(True)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=0.0)
    count = len(features.accepted)
    steps = math.ceil(config.epochs * math.ceil(count / config.batch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    batches, running = shuffled_rows(count, config.batch, config.seed), None
    started = time.perf_counter()
    head.train()
    for _ in tqdm(range(steps), desc=desc, unit="step", dynamic_ncols=True):
        rows = next(batches)
        loss = weighted_bce(head(features.hidden[rows].float()), features.accepted[rows], config.reject_weight)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        value = float(loss.detach())
        running = value if running is None else 0.9 * running + 0.1 * value
    head.eval()
    with torch.no_grad():
        predicted = torch.sigmoid(head(features.hidden.float()))
    accepted = features.accepted > 0.5
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "steps": steps,
        "examples": count,
        "final_loss": round(running, 4),
        "acceptance_rate": round(float(accepted.float().mean()), 4),
        "predicted_if_accepted": round(float(predicted[accepted].mean()), 4) if accepted.any() else None,
        "predicted_if_rejected": round(float(predicted[~accepted].mean()), 4) if (~accepted).any() else None,
    }


def train_head(
    label: str, features: AcceptanceFeatures, config, seed: int, folder: Path, info: dict, answers: int
) -> str:
    """Train and save an acceptance head on its features (config: the method's section, with depth, epochs,
    learning_rate, batch and reject_weight) -> the stage's log line."""
    torch.manual_seed(seed)
    head = AcceptanceHead(features.hidden.shape[1], config.depth)
    training = AcceptanceTraining(config.epochs, config.learning_rate, config.batch, config.reject_weight, seed)
    result = train_acceptance(head, features, training, desc=f"train {label}")
    save_acceptance_head(head, folder, {**info, **result})
    return (
        f"{result['seconds'] / 60:.1f} min on {result['examples']} drafts of {info['answers']} of {answers} own "
        f"answers (accepted {result['acceptance_rate']:.0%}; mean prediction {result['predicted_if_accepted']} "
        f"where accepted, {result['predicted_if_rejected']} where not)"
    )
