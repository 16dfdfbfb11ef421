"""Method ss-adaptive's acceptance head, trained on the frozen SS model's stream states over its own answers.

Greedy verification accepts stream d's top token at a node exactly when it is the target's token d
places on, and a step asks about depth d only where the top tokens above it were accepted
(runtime/speculation/tree_choice.py tilts the other ranks). Teacher-forced on the model's own greedy answers,
the context of each anchor is the one decoding sees, so one pass per answer gives every example:
(stream d's final state at the anchor, whether its top token equals the answer token d places past
the anchor's next), for each depth whose tops above were all right. The head is SpecDec++'s
(adapters/acceptance.py), trained with its weighted BCE (training/acceptance.py); at reject_weight 1 its output is a
probability, which the per-step tree choice needs (a larger weight would bias every step shallower).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.training.acceptance import AcceptanceFeatures, collect_features
from streamfuse.training.data import Encoded, collate
from streamfuse.training.loss import stream_targets
from streamfuse.training.train import forward_batch


@torch.inference_mode()
def item_features(model: SpeculativeStreamingLM, item: Encoded, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ([P, H] stream states, [P] 1.0 where the stream's top token is accepted). Anchors run from the
    last prompt token to the answer's third-to-last (a step follows each: calibration's positions)."""
    batch = collate([item], pad_id)
    output = forward_batch(model, batch, with_streams=True)
    asked = batch.anchor_valid[0].clone()
    asked[-1] = False  # the root after the last anchor is the answer's last token: no step follows it
    hidden, accepted = [], []
    for depth in range(1, model.num_streams + 1):
        targets = stream_targets(batch.labels, batch.anchors, batch.anchor_valid, depth)[0]
        states = output.stream_hidden[0, :, depth - 1]
        asked = asked & (targets >= 0)
        hit = model.logits(states).argmax(-1) == targets
        hidden.append(states[asked])
        accepted.append(hit[asked].float())
        asked = asked & hit
    return torch.cat(hidden), torch.cat(accepted)


def stream_acceptance_features(
    model: SpeculativeStreamingLM, items: Sequence[Encoded], pad_id: int, cache: Path
) -> AcceptanceFeatures:
    """Every item's examples (cached in `cache`, a safetensors file, per SS model)."""
    return collect_features(items, lambda item: item_features(model, item, pad_id), cache, "ss-adaptive")
