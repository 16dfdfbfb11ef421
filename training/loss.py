"""The Speculative Streaming objective (paper eq. 5) plus the pruning head's next-token loss.

Position p holds token x_p. The main stream at p predicts x_{p+1}; stream j inserted at p
predicts x_{p+1+j}. `labels[b, q]` is the answer token at q (IGNORE elsewhere), so the main
target of p is labels[p+1] and stream j's is labels[p+1+j]. Each term is a mean over its valid
targets (the alphas of eq. 5 then weigh comparable magnitudes). Rows with main_loss False (the
model's own answers in self-distillation) give no main-stream term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamfuse.adapters.model import SpeculativeStreamingLM, StreamingOutput
from streamfuse.training.data import IGNORE, Batch


def _cross_entropy(model: SpeculativeStreamingLM, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean CE over rows whose target is not IGNORE; the LM head runs on those rows only."""
    keep = targets != IGNORE
    if not bool(keep.any()):
        return hidden.sum() * 0.0
    return F.cross_entropy(model.logits(hidden[keep]).float(), targets[keep])


def stream_targets(
    labels: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, offset: int
) -> torch.Tensor:
    """[B, A] target of the stream `offset` tokens ahead of each anchor's next token."""
    index = anchors + 1 + offset
    inside = index < labels.shape[1]
    targets = torch.gather(labels, 1, index.clamp(max=labels.shape[1] - 1))
    return torch.where(inside & anchor_valid, targets, torch.full_like(targets, IGNORE))


def streaming_loss(
    model: SpeculativeStreamingLM,
    output: StreamingOutput,
    batch: Batch,
    main_weight: float = 1.0,
    stream_weight: float = 0.1,
    pruning_weight: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Returns {"total", "main", "stream_1".."stream_g", "pruning"} (present terms only)."""
    main_targets = batch.labels[:, 1:]
    main_rows = torch.where(batch.main_loss[:, None], main_targets, torch.full_like(main_targets, IGNORE))
    terms = {"main": _cross_entropy(model, output.hidden[:, :-1], main_rows)}
    total = main_weight * terms["main"]
    if output.stream_hidden is not None:
        for j in range(1, output.stream_hidden.shape[2] + 1):
            targets = stream_targets(batch.labels, batch.anchors, batch.anchor_valid, j)
            terms[f"stream_{j}"] = _cross_entropy(model, output.stream_hidden[:, :, j - 1], targets)
            total = total + stream_weight * terms[f"stream_{j}"]
    if output.pruning_hidden is not None:
        terms["pruning"] = _cross_entropy(model, output.pruning_hidden[:, :-1], main_targets)
        total = total + pruning_weight * terms["pruning"]
    terms["total"] = total
    return terms
