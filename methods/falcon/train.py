"""Falcon training (Gao et al. 2024): the semi-autoregressive drafter of model.py beside this file, self-distilled on
the frozen target's states over its own greedy answers (methods/fused/train.py's answer_states), with Coupled
Sequential Glancing Distillation (CSGD).

An answer of A tokens gives A real rows, row p reading (h_p, a_p) at position p; they hold the context. Each
t >= k - 1 opens a group of m blocks of k rows, the runtime's m passes at the step whose last real row is t:
block 1 repeats real rows t-k+1..t, block b >= 2 reads positions t+(b-2)k+1.. with the states and tokens
block b - 1 predicted there. A row at position p learns h_{p+k} and a_{p+k}. Block rows see the real rows up
to t, the group's blocks 2..b and all of their own block (the relaxed causal mask).

CSGD: a no-grad pass per block fills blocks 2..m with the drafter's own predictions, then in each group a run
of n = λ·(mispredicted inputs) of them, the first ones (those just after the true context), gets the true
state and token back (λ = 0.4 (E - e) / E falls to 0 over the epochs; n rounded at random, unbiased); the
gradient pass follows. Without CSGD the blocks read the true states and tokens (teacher forcing). Loss per
row: SmoothL1(ĥ, h) + 0.1 (0.9 KL(p || p̂) + 0.1 CE), p the target's distribution from h over the kept
vocabulary; U(-0.1, 0.1) noise on the input states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.falcon.model import FalconModel
from streamfuse.methods.fused.train import IGNORE, AnswerStates, Loop, Piece, train_fused, vocab_columns
from streamfuse.training.data import Encoded


@dataclass(frozen=True)
class FalconLayout:
    inputs: torch.Tensor  # [N] answer index p each row reads (h_p, a_p) at: its position
    targets: torch.Tensor  # [N] answer index p + k it learns, IGNORE for none (real rows, past the end)
    feeder: torch.Tensor  # [N] the row whose prediction is this row's input (-1: the truth only)
    group: torch.Tensor  # [N] its group (-1: a real row)
    visible: torch.Tensor  # [N, N] bool


def falcon_layout(rows: int, block: int, passes: int) -> FalconLayout:
    """One answer's training rows: `rows` real rows, then for each t >= block - 1 its group of `passes` blocks."""
    inputs, feeder, group, kind, context = list(range(rows)), [-1] * rows, [-1] * rows, [0] * rows, list(range(rows))
    for t in range(block - 1, rows - 1):
        previous: list[int] = []
        for b in range(1, passes + 1):
            start = t - block + 1 if b == 1 else t + (b - 2) * block + 1
            placed = []
            for j, p in enumerate(range(start, min(start + block, rows))):
                feeder.append(previous[j] if b > 1 else -1)
                placed.append(len(inputs))
                inputs.append(p)
                group.append(t)
                kind.append(b)
                context.append(t)
            previous = placed
    inputs_, group_, kind_, context_ = (torch.tensor(v) for v in (inputs, group, kind, context))
    targets = torch.where((kind_ > 0) & (inputs_ + block < rows), inputs_ + block, torch.full_like(inputs_, IGNORE))
    sees_real = (kind_[None, :] == 0) & (inputs_[None, :] <= context_[:, None])
    sees_blocks = (
        (kind_[None, :] >= 2)
        & (group_[None, :] == group_[:, None])
        & (kind_[None, :] <= kind_[:, None])
        & (group_[:, None] >= 0)
    )
    return FalconLayout(inputs_, targets, torch.tensor(feeder), group_, sees_real | sees_blocks)


@dataclass(frozen=True)
class FalconTraining:
    epochs: float = 6.0  # the build's falcon section sets these (build.py beside this file: why these)
    learning_rate: float = 1.5e-3
    items: int = 8  # answers per step, packed into one sequence
    passes: int = 2  # blocks per group (the runtime may run more passes: later ones read predicted inputs too)
    glance: bool = True  # CSGD; False: teacher forcing
    noise: float = 0.1  # U(-noise, noise) on the input states
    distill_weight: float = 0.1  # the paper's: SmoothL1 + 0.1 (0.9 KL + 0.1 CE)
    seed: int = 0


@dataclass
class Packed:
    """Answers packed into one sequence (block-diagonal attention): each row's true input and its target."""

    states: torch.Tensor  # [N, H] true input states (noised)
    tokens: torch.Tensor  # [N] true input tokens
    positions: torch.Tensor  # [N]
    feeder: torch.Tensor  # [N] packed row index feeding it, -1 none
    group: torch.Tensor  # [N] a packed group id, -1 for real rows
    target_states: torch.Tensor  # [N, H] (zeros where no target)
    target_tokens: torch.Tensor  # [N] IGNORE where no target
    mask: torch.Tensor  # [1, 1, N, N] additive


def pack(
    pieces: Sequence[Piece], block: int, passes: int, noise: float, generator: torch.Generator | None = None
) -> Packed:
    """pieces: (states [A, H], answer tokens [A]) -> the packed rows of their falcon_layouts."""
    parts, offset, groups = [], 0, 0
    for hidden, answer in pieces:
        layout = falcon_layout(len(answer), block, passes)
        tokens = torch.tensor(list(answer))
        has = layout.targets != IGNORE
        target = layout.targets.clamp(min=0)
        parts.append(
            (
                hidden[layout.inputs],
                tokens[layout.inputs],
                layout.inputs,
                torch.where(layout.feeder >= 0, layout.feeder + offset, layout.feeder),
                torch.where(layout.group >= 0, layout.group + groups, layout.group),
                hidden[target] * has[:, None],
                torch.where(has, tokens[target], torch.full_like(target, IGNORE)),
                layout.visible,
            )
        )
        offset, groups = offset + len(layout.inputs), groups + len(answer)
    states, tokens, positions, feeder, group, target_states, target_tokens, blocks = zip(*parts)
    states = torch.cat(states)
    if noise > 0:
        states = states + (torch.rand(states.shape, generator=generator) * 2 - 1) * noise
    visible = torch.block_diag(*blocks)
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    return Packed(
        states,
        torch.cat(tokens),
        torch.cat(positions),
        torch.cat(feeder),
        torch.cat(group),
        torch.cat(target_states),
        torch.cat(target_tokens),
        mask,
    )


def forward(
    drafter: FalconModel, embed: torch.nn.Module, packed: Packed, states: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter over the packed rows with these inputs -> (predicted states [N, H], logits [N, D])."""
    predicted, logits = drafter(
        states[None], embed(tokens)[None], packed.positions[None], packed.mask, StepKeyValues(1, len(tokens))
    )
    return predicted[0], logits[0]


@torch.no_grad()
def glanced_inputs(
    drafter: FalconModel,
    embed: torch.nn.Module,
    packed: Packed,
    passes: int,
    share: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSGD's inputs: blocks 2..passes read the drafter's own predictions (one no-grad pass per block), then in
    each group the first n of them take the truth back, n = share x (mispredicted tokens there) rounded at
    random."""
    states, tokens = packed.states.clone(), packed.tokens.clone()
    fed = packed.feeder >= 0
    for _ in range(passes - 1):
        predicted, logits = forward(drafter, embed, packed, states, tokens)
        states[fed] = predicted[packed.feeder[fed]]
        tokens[fed] = drafter.vocab_ids[logits[packed.feeder[fed]].argmax(-1)]
    wrong = fed & (tokens != packed.tokens)
    groups = packed.group[fed]
    counts = torch.zeros(int(packed.group.max()) + 1).index_add_(0, groups, wrong[fed].float())
    quota = torch.floor(share * counts + torch.rand(counts.shape, generator=generator)).long()
    rank = _rank_in_group(groups)
    back = torch.zeros_like(fed)
    back[fed] = rank < quota[groups]
    states[back], tokens[back] = packed.states[back], packed.tokens[back]
    return states, tokens


def _rank_in_group(groups: torch.Tensor) -> torch.Tensor:
    """Each entry's index among its group's entries, in order (groups are contiguous runs)."""
    index = torch.arange(len(groups))
    starts = torch.ones_like(groups, dtype=torch.bool)
    starts[1:] = groups[1:] != groups[:-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    return index - first


def falcon_losses(
    drafter: FalconModel, predicted: torch.Tensor, logits: torch.Tensor, packed: Packed, distill_weight: float
) -> dict[str, torch.Tensor]:
    """The rows with a target: SmoothL1 on the states, KL and CE on the kept vocabulary, and their sum."""
    keep = packed.target_tokens != IGNORE
    regression = F.smooth_l1_loss(predicted[keep], packed.target_states[keep])
    draft = F.log_softmax(logits[keep].float(), -1)
    with torch.no_grad():
        target = F.log_softmax(drafter.head(packed.target_states[keep]).float(), -1)
    kl = F.kl_div(draft, target, log_target=True, reduction="batchmean")
    columns = vocab_columns(drafter.vocab_ids, packed.target_tokens[keep])
    ce = F.nll_loss(draft, columns, ignore_index=IGNORE) if (columns != IGNORE).any() else draft.sum() * 0.0
    total = regression + distill_weight * (0.9 * kl + 0.1 * ce)
    return {"total": total, "smooth_l1": regression, "kl": kl, "ce": ce}


def train_falcon(
    drafter: FalconModel, embed: torch.nn.Module, items: Sequence[Encoded], states: AnswerStates, config: FalconTraining
) -> dict:
    """Train the drafter in place (its head and the shared embedding stay frozen); returns the final losses and
    the time."""
    generator = torch.Generator().manual_seed(config.seed)

    def step(pieces: list[Piece], index: int, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        packed = pack(pieces, drafter.block, config.passes, config.noise, generator)
        share = 0.4 * (1 - index / steps)  # λ = 0.4 (E - e) / E
        inputs = (
            glanced_inputs(drafter, embed, packed, config.passes, share, generator)
            if config.glance
            else (packed.states, packed.tokens)
        )
        losses = falcon_losses(drafter, *forward(drafter, embed, packed, *inputs), packed, config.distill_weight)
        return losses["total"], {k: v.detach() for k, v in losses.items()}

    loop = Loop(config.epochs, config.learning_rate, config.items, config.seed, "falcon", betas=(0.9, 0.95))
    return train_fused(drafter, embed, items, states, loop, step)
