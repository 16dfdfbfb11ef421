"""SpecDec++'s acceptance head, trained on the frozen draft model over the target's own greedy answers.

Greedy verification accepts a draft token exactly when it is the target's next token, and the head
is asked about a draft only while every draft before it was accepted, that is, with the target's own
answer as context. So each answer position t past the first gives one example, exact, with no target
pass: d_t, the draft model's argmax after the answer's first t tokens, is accepted (label 1) when it
equals answer token t; the head reads the draft's state at d_t's own position. Accepted, that state
is the one over the answer itself; rejected, d_t sits in a branch beside the answer (the tree mask:
it sees the answer before t and itself), so one teacher-forced pass per item gives both. (The paper
mixes draft and target tokens and labels sampled drafts min(1, p/q); at temperature 0 that reduces
to this, and at T > 0 the head still only decides lengths, so decoding stays lossless.)
The loss is the paper's weighted BCE: rejections weigh `reject_weight`, acceptances 1.
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

from streamfuse.adapters.acceptance import AcceptanceHead
from streamfuse.adapters.masks import additive
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.training.data import Encoded, shuffled_rows
from streamfuse.training.feature_cache import load_features, save_features


@dataclass(frozen=True)
class AcceptanceFeatures:
    hidden: torch.Tensor  # [P, H] the draft model's final-normed state at each draft token's own position
    accepted: torch.Tensor  # [P] 1.0 where greedy verification accepts that draft token, else 0.0


def branch_inputs(ids: Sequence[int], drafts: dict[int, int]) -> tuple[list[int], list[int], torch.Tensor]:
    """The sequence `ids` plus one branch token per entry t -> d of `drafts`, at position t, seeing
    ids[:t] and itself: -> (tokens, positions, [T', T'] boolean visibility)."""
    length = len(ids)
    tokens = list(ids) + list(drafts.values())
    positions = list(range(length)) + list(drafts)
    size = len(tokens)
    visible = torch.zeros(size, size, dtype=torch.bool)
    visible[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    for row, t in enumerate(drafts, start=length):
        visible[row, :t] = True
        visible[row, row] = True
    return tokens, positions, visible


@torch.inference_mode()
def item_features(model: SpeculativeStreamingLM, item: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
    """One item's examples: answer positions prompt_len + 1 .. end (the first answer token is the
    target's own, never drafted)."""
    ids = item.input_ids
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], additive(causal[None, None]))
    first = item.prompt_len + 1
    drafted = model.logits(out.hidden[0, first - 1 : len(ids) - 1]).argmax(-1).tolist()
    truth = ids[first:]
    rejected = {t: d for t, (d, y) in enumerate(zip(drafted, truth), start=first) if d != y}
    hidden = out.hidden[0, first:].clone()
    if rejected:
        tokens, positions, visible = branch_inputs(ids, rejected)
        branch = model(torch.tensor([tokens]), torch.tensor([positions]), additive(visible[None, None]))
        for row, t in enumerate(rejected, start=len(ids)):
            hidden[t - first] = branch.hidden[0, row]
    accepted = torch.tensor([float(d == y) for d, y in zip(drafted, truth)])
    return hidden, accepted


def acceptance_features(model: SpeculativeStreamingLM, items: Sequence[Encoded], cache: Path) -> AcceptanceFeatures:
    """Every item's examples (cached in `cache`, a safetensors file, per draft model)."""
    return collect_features(items, lambda item: item_features(model, item), cache, "specdec++")


def collect_features(items: Sequence[Encoded], examples: Callable[[Encoded], tuple[torch.Tensor, torch.Tensor]],
                     cache: Path, method: str) -> AcceptanceFeatures:
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
    reject_weight: float = 6.0  # the paper's w_rej (w_acc = 1): it pays to stop before a likely rejection
    seed: int = 0


def weighted_bce(logits: torch.Tensor, accepted: torch.Tensor, reject_weight: float) -> torch.Tensor:
    weights = torch.where(accepted > 0.5, 1.0, reject_weight)
    return F.binary_cross_entropy_with_logits(logits, accepted, weight=weights)


def train_acceptance(head: AcceptanceHead, features: AcceptanceFeatures, config: AcceptanceTraining,
                     desc: str = "train specdec++") -> dict:
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
    return {"seconds": round(time.perf_counter() - started, 1), "steps": steps, "examples": count,
            "final_loss": round(running, 4), "acceptance_rate": round(float(accepted.float().mean()), 4),
            "predicted_if_accepted": round(float(predicted[accepted].mean()), 4) if accepted.any() else None,
            "predicted_if_rejected": round(float(predicted[~accepted].mean()), 4) if (~accepted).any() else None}
