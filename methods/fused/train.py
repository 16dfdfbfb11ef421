"""What training the fused drafters (methods/fused/model.py: ParallelSpec's and Falcon's) shares: the frozen target's
states over its own greedy answers, their pieces per answer, the fused input's starting scale, the kept vocabulary's
columns and the training loop around a method's own step.

One pass of the target over each prompt + own answer gives its final-normed states at the answer-predicting
positions (cached on disk per target); each method packs them into its own rows and losses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from streamfuse.adapters.masks import causal_mask
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.methods.fused.model import FusedDrafter
from streamfuse.training.data import Encoded, shuffled_rows
from streamfuse.training.feature_cache import load_features, save_features

IGNORE = -100
Piece = tuple[torch.Tensor, Sequence[int]]  # an answer's target states [A, H] and its tokens [A]


@dataclass(frozen=True)
class AnswerStates:
    hidden: torch.Tensor  # [N, H] the target's final-normed states at every answer-predicting position, item-major
    lengths: torch.Tensor  # [items] answer tokens per item (its rows in hidden)


@torch.inference_mode()
def answer_states(model: SpeculativeStreamingLM, items: Sequence[Encoded], cache: Path) -> AnswerStates:
    """The target's states over every item (cached in `cache`, a safetensors file)."""
    if (stored := load_features(cache)) is not None:
        return AnswerStates(stored["hidden"], stored["lengths"])
    hidden = []
    for item in tqdm(items, desc="answer states", unit="ex", dynamic_ncols=True):
        ids = torch.tensor([item.input_ids])
        out = model(ids, torch.arange(ids.shape[1])[None], causal_mask(torch.ones_like(ids)))
        hidden.append(out.hidden[0, item.prompt_len - 1 : len(item.input_ids) - 1].to(torch.float16))
    states = AnswerStates(torch.cat(hidden), torch.tensor([len(h) for h in hidden]))
    save_features(cache, {"hidden": states.hidden, "lengths": states.lengths})
    return states


def answer_pieces(items: Sequence[Encoded], states: AnswerStates) -> list[Piece]:
    """Each item's (target states [A, H] as float, own answer [A]); a cache of other answers is refused."""
    answers = [list(item.input_ids[item.prompt_len :]) for item in items]
    if [len(a) for a in answers] != states.lengths.tolist():
        raise ValueError("the cached target states do not match these answers: delete the cache and rerun")
    return list(zip(torch.split(states.hidden.float(), states.lengths.tolist()), answers))


def embed_scale(states: AnswerStates, embed: torch.nn.Module) -> float:
    """rms(target states) / rms(token embeddings): the fused input's starting weight on the embedding."""
    sample = states.hidden[:: max(1, len(states.hidden) // 4096)].float()
    return float(sample.pow(2).mean().sqrt() / embed.weight.detach().float().pow(2).mean().sqrt())


def vocab_columns(vocab_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids -> the drafter's logits columns; IGNORE for tokens outside its vocabulary (and IGNORE)."""
    column = torch.searchsorted(vocab_ids, tokens.clamp(min=0)).clamp(max=len(vocab_ids) - 1)
    inside = (tokens >= 0) & (vocab_ids[column] == tokens)
    return torch.where(inside, column, torch.full_like(column, IGNORE))


@dataclass(frozen=True)
class Loop:
    """The training loop's settings: epochs over the answers, `per_step` answers a step, AdamW at a learning rate
    falling linearly to zero, the batches' seed and the progress bar's label."""

    epochs: float
    learning_rate: float
    per_step: int
    seed: int
    label: str
    betas: tuple[float, float] = (0.9, 0.999)


# step(pieces of this step's answers, step index, steps) -> (the loss to minimise, named losses to report)
Step = Callable[[list[Piece], int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train_fused(
    drafter: FusedDrafter,
    embed: torch.nn.Module,
    items: Sequence[Encoded],
    states: AnswerStates,
    loop: Loop,
    step: Step,
) -> dict:
    """Train the drafter in place (its head and the shared embedding stay frozen) with a method's step; returns
    the final running mean of each named loss, the steps and the time."""
    embed.requires_grad_(False)
    drafter.requires_grad_(True)
    drafter.head.requires_grad_(False)
    pieces = answer_pieces(items, states)
    optimizer = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad], lr=loop.learning_rate, betas=loop.betas, weight_decay=0.0
    )
    steps = math.ceil(loop.epochs * math.ceil(len(items) / loop.per_step))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda index: 1 - index / steps)
    batches, running = shuffled_rows(len(items), loop.per_step, loop.seed), {}
    started = time.perf_counter()
    drafter.train()
    for index in tqdm(range(steps), desc=f"train {loop.label}", unit="step", dynamic_ncols=True):
        total, losses = step([pieces[i] for i in next(batches)], index, steps)
        total.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        running = {k: 0.9 * running.get(k, float(v)) + 0.1 * float(v) for k, v in losses.items()}
    drafter.eval()
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "steps": steps,
        "final_losses": {k: round(v, 4) for k, v in running.items()},
    }
