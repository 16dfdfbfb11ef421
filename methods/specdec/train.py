"""SpecDec++'s acceptance head (its torch module: adapters/acceptance.py), trained on sd's frozen draft model over
the target's own greedy answers (the loop: training/acceptance.py).

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

from collections.abc import Sequence
from pathlib import Path

import torch

from streamfuse.adapters.masks import additive
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.training.acceptance import AcceptanceFeatures, collect_features
from streamfuse.training.data import Encoded


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
