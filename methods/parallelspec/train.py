"""ParallelSpec training (Xiao et al. 2024, group-wise parallel training) of the drafter in model.py beside this
file, self-distilled: on the frozen target's states over its own greedy answers (methods/fused/train.py).

An answer of A tokens a_0..a_{A-1} gives A real rows, row t reading (h, a_t) at the position before a_t and
learning a_{t+1}; each real row opens a group of k [MASK] rows, [MASK]_j at position t + j learning a_{t+1+j},
seeing real rows 0..t and [MASK]_1..j of its own group (the runtime's view at a step: its cache, the last real
row, the masks). The loss weighs [MASK]_j by decay^j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.fused.train import IGNORE, AnswerStates, Loop, Piece, train_fused, vocab_columns
from streamfuse.methods.parallelspec.model import ParallelSpecModel
from streamfuse.training.data import Encoded


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
    sees_mask = (
        is_mask[None, :] & is_mask[:, None] & (owner[None, :] == owner[:, None]) & (rank[None, :] <= rank[:, None])
    )
    return offsets, labels, sees_real | sees_mask


@dataclass(frozen=True)
class DrafterTraining:
    epochs: float = 10.0  # the build's parallelspec section sets these (build.py beside this file: why these)
    learning_rate: float = 1.5e-3
    items: int = 8  # answers per step, packed into one sequence
    decay: float = 0.8  # [MASK]_j's loss weight is decay^j
    seed: int = 0


def train_drafter(
    drafter: ParallelSpecModel,
    embed: torch.nn.Module,
    items: Sequence[Encoded],
    states: AnswerStates,
    config: DrafterTraining,
) -> dict:
    """Train the drafter in place (its head and the shared embedding stay frozen); returns the final mean loss of
    the real rows and of each mask, and the time."""
    weights = torch.tensor([config.decay**j for j in range(drafter.num_masks + 1)])
    names = ["real", *(f"mask_{j}" for j in range(1, drafter.num_masks + 1))]

    def step(pieces: list[Piece], index: int, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        losses = drafter_losses(drafter, embed, pieces)
        return (weights * losses).sum(), dict(zip(names, losses.detach()))

    loop = Loop(config.epochs, config.learning_rate, config.items, config.seed, "parallelspec")
    return train_fused(drafter, embed, items, states, loop, step)


def drafter_losses(drafter: ParallelSpecModel, embed: torch.nn.Module, pieces: Sequence[Piece]) -> torch.Tensor:
    """[1 + masks] mean cross-entropy of the real rows and of each [MASK]_j (packed_logits' rows). Labels outside
    the drafter's vocabulary are left out: its q is zero there."""
    logits, labels, rank = packed_logits(drafter, embed, pieces)
    target = vocab_columns(drafter.vocab_ids, labels)
    losses = []
    for j in range(drafter.num_masks + 1):
        keep = (rank == j) & (target != IGNORE)
        losses.append(F.cross_entropy(logits[keep].float(), target[keep]) if keep.any() else logits.sum() * 0.0)
    return torch.stack(losses)


def packed_logits(
    drafter: ParallelSpecModel, embed: torch.nn.Module, pieces: Sequence[Piece]
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
        ranks.append(
            torch.cat([torch.zeros(len(answer), dtype=torch.long), torch.arange(1, masks + 1).repeat(len(answer))])
        )
        blocks.append(visible)
    visible = torch.block_diag(*blocks)
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    logits = drafter.run(torch.cat(rows)[None], torch.cat(positions)[None], mask, StepKeyValues(1, len(visible)))[0]
    return logits, torch.cat(labels), torch.cat(ranks)
