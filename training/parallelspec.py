"""ParallelSpec training (Xiao et al. 2024, group-wise parallel training) of the drafter in
adapters/parallelspec.py, self-distilled: on the frozen target's states over its own greedy answers.

One pass of the target over each prompt + own answer gives its final-normed states at the answer-predicting
positions (cached on disk per target). An answer of A tokens a_0..a_{A-1} gives A real rows, row t reading
(h, a_t) at the position before a_t and learning a_{t+1}; each real row opens a group of k [MASK] rows,
[MASK]_j at position t + j learning a_{t+1+j}, seeing real rows 0..t and [MASK]_1..j of its own group (the
runtime's view at a step: its cache, the last real row, the masks). The loss weighs [MASK]_j by decay^j.
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
from streamfuse.adapters.msa import StepKeyValues
from streamfuse.adapters.parallelspec import ParallelSpecModel
from streamfuse.training.data import Encoded, shuffled_rows
from streamfuse.training.feature_cache import load_features, save_features

IGNORE = -100


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
    for item in tqdm(items, desc="parallelspec features", unit="ex", dynamic_ncols=True):
        ids = torch.tensor([item.input_ids])
        out = model(ids, torch.arange(ids.shape[1])[None], causal_mask(torch.ones_like(ids)))
        hidden.append(out.hidden[0, item.prompt_len - 1 : len(item.input_ids) - 1].to(torch.float16))
    states = AnswerStates(torch.cat(hidden), torch.tensor([len(h) for h in hidden]))
    save_features(cache, {"hidden": states.hidden, "lengths": states.lengths})
    return states


def answer_pieces(items: Sequence[Encoded], states: AnswerStates) -> list[tuple[torch.Tensor, list[int]]]:
    """Each item's (target states [A, H] as float, own answer [A]); a cache of other answers is refused."""
    answers = [list(item.input_ids[item.prompt_len :]) for item in items]
    if [len(a) for a in answers] != states.lengths.tolist():
        raise ValueError("the cached target states do not match these answers: delete the cache and rerun")
    return list(zip(torch.split(states.hidden.float(), states.lengths.tolist()), answers))


def embed_scale(states: AnswerStates, embed: torch.nn.Module) -> float:
    """rms(target states) / rms(token embeddings): the fused input's starting weight on the embedding."""
    sample = states.hidden[:: max(1, len(states.hidden) // 4096)].float()
    return float(sample.pow(2).mean().sqrt() / embed.weight.detach().float().pow(2).mean().sqrt())


def group_layout(rows: int, masks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One answer's training rows: `rows` real rows, then group t's `masks` mask rows for each t in turn.
    -> (offsets [N] position after the first real row, labels [N] answer index each row learns (t + 1 + j),
    visible [N, N] bool: real row t sees real rows <= t; [MASK]_j of group t sees those and [MASK]_1..j)."""
    t = torch.arange(rows)
    group, j = t.repeat_interleave(masks), torch.arange(1, masks + 1).repeat(rows)
    offsets = torch.cat([t, group + j])
    labels = torch.cat([t + 1, group + 1 + j])
    owner = torch.cat([t, group])  # the real row whose context each row has
    is_mask = torch.arange(len(offsets)) >= rows
    sees_real = ~is_mask[None, :] & (owner[None, :] <= owner[:, None])
    rank = torch.cat([torch.zeros(rows, dtype=torch.long), j])
    sees_mask = is_mask[None, :] & is_mask[:, None] & (owner[None, :] == owner[:, None]) & (rank[None, :] <= rank[:, None])
    return offsets, labels, sees_real | sees_mask


@dataclass(frozen=True)
class DrafterTraining:
    epochs: float = 10.0  # the build's parallelspec section sets these (training/config.py: why these)
    learning_rate: float = 1.5e-3
    items: int = 8  # answers per step, packed into one sequence
    decay: float = 0.8  # [MASK]_j's loss weight is decay^j
    seed: int = 0


def train_drafter(drafter: ParallelSpecModel, embed: torch.nn.Module, items: Sequence[Encoded], states: AnswerStates,
                  config: DrafterTraining) -> dict:
    """Train the drafter in place (its head and the shared embedding stay frozen); returns the final mean loss of
    the real rows and of each mask, and the time."""
    embed.requires_grad_(False)
    drafter.requires_grad_(True)
    drafter.head.requires_grad_(False)
    pieces = answer_pieces(items, states)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=0.0)
    steps = math.ceil(config.epochs * math.ceil(len(items) / config.items))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    weights = torch.tensor([config.decay ** j for j in range(drafter.num_masks + 1)])
    batches, running = shuffled_rows(len(items), config.items, config.seed), torch.zeros(drafter.num_masks + 1)
    started = time.perf_counter()
    drafter.train()
    for _ in tqdm(range(steps), desc="train parallelspec", unit="step", dynamic_ncols=True):
        losses = drafter_losses(drafter, embed, [pieces[i] for i in next(batches)])
        (weights * losses).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        running = 0.9 * running + 0.1 * losses.detach() if running.any() else losses.detach()
    drafter.eval()
    return {"seconds": round(time.perf_counter() - started, 1), "steps": steps,
            "final_losses": {("real" if j == 0 else f"mask_{j}"): round(float(v), 4) for j, v in enumerate(running)}}


def drafter_losses(drafter: ParallelSpecModel, embed: torch.nn.Module,
                   pieces: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> torch.Tensor:
    """[1 + masks] mean cross-entropy of the real rows and of each [MASK]_j (packed_logits' rows). Labels outside
    the drafter's vocabulary are left out: its q is zero there."""
    logits, labels, rank = packed_logits(drafter, embed, pieces)
    target = vocab_columns(drafter.vocab_ids, labels)
    losses = []
    for j in range(drafter.num_masks + 1):
        keep = (rank == j) & (target != IGNORE)
        losses.append(F.cross_entropy(logits[keep].float(), target[keep]) if keep.any() else logits.sum() * 0.0)
    return torch.stack(losses)


def packed_logits(drafter: ParallelSpecModel, embed: torch.nn.Module, pieces: Sequence[tuple[torch.Tensor, Sequence[int]]]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Answers packed into one sequence, each its group_layout (attention block-diagonal); pieces: (states [A, H],
    answer tokens [A]). -> (logits [N, D], label token ids [N] (IGNORE past an answer's end), rank [N]: 0 for a
    real row, j for [MASK]_j)."""
    masks = drafter.num_masks
    rows, positions, labels, ranks, blocks = [], [], [], [], []
    for hidden, answer in pieces:
        offsets, label_index, visible = group_layout(len(answer), masks)
        real = drafter.fuse(torch.cat([hidden, embed(torch.tensor(list(answer)))], dim=-1))
        rows.append(torch.cat([real, drafter.mask_inputs.repeat(len(answer), 1)]))
        positions.append(offsets)
        labels.append(torch.tensor(list(answer) + [IGNORE] * (masks + 1))[label_index])
        ranks.append(torch.cat([torch.zeros(len(answer), dtype=torch.long), torch.arange(1, masks + 1).repeat(len(answer))]))
        blocks.append(visible)
    visible = torch.block_diag(*blocks)
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    logits = drafter.run(torch.cat(rows)[None], torch.cat(positions)[None], mask, StepKeyValues(1, len(visible)))[0]
    return logits, torch.cat(labels), torch.cat(ranks)


def vocab_columns(vocab_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Token ids -> the drafter's logits columns; IGNORE for tokens outside its vocabulary (and IGNORE)."""
    column = torch.searchsorted(vocab_ids, tokens.clamp(min=0)).clamp(max=len(vocab_ids) - 1)
    inside = (tokens >= 0) & (vocab_ids[column] == tokens)
    return torch.where(inside, column, torch.full_like(column, IGNORE))
