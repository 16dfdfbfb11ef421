"""ParallelSpec's drafter pass as one static graph (ExecuTorch .pte, ONNX), run by its graph pass (graph_pass.py
beside this file; the writers and the check it shares with Falcon's: methods/fused/graph.py):

    draft(states [R, H], embeds [R, H], positions [R + k], read [k + 1], mask [R + k, C + R + k],
          keys [1, kv, C, d], values [1, kv, C, d]) -> logits [k + 1, D], new_keys [1, kv, R, d], new_values

R real rows (the pass's accepted nodes, padded), k [MASK] rows, a cache of C slots; the mask is the host's
(its drafter's pass_visibility), so the graph needs no cache length; the head runs on the `read` rows only (the
last real row and the masks). The token embeddings come from the host's table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.fused.graph import PassGraph, PassModule
from streamfuse.methods.parallelspec.graph_pass import GraphParallelPass
from streamfuse.methods.parallelspec.model import ParallelSpecModel

OUTPUT_NAMES = ["logits", "new_keys", "new_values"]


class DraftPass(PassModule):
    def draft(self, states, embeds, positions, read, mask, cache: StepKeyValues) -> tuple[torch.Tensor, ...]:
        inputs = self.drafter.inputs(states[None], embeds[None], self.drafter.num_masks)
        hidden = self.drafter.states(inputs, positions[None], mask[None, None], cache)[0]
        return (self.drafter.head(hidden[read]),)


def example_inputs(drafter: ParallelSpecModel, rows: int, capacity: int) -> tuple[torch.Tensor, ...]:
    attention = drafter.layer.self_attn
    kv_heads = attention.config.num_key_value_heads
    hidden, masks = drafter.head.in_features, drafter.num_masks
    cache = torch.zeros(1, kv_heads, capacity, attention.head_dim)
    return (
        torch.zeros(rows, hidden),
        torch.zeros(rows, hidden),
        torch.arange(rows + masks),
        torch.arange(rows - 1, rows + masks),
        torch.zeros(rows + masks, capacity + rows + masks),
        cache,
        cache.clone(),
    )


def export_drafter(
    drafter: ParallelSpecModel,
    embed: nn.Module,
    rows: int,
    capacity: int,
    engines: list[str],
    folder: Path,
    quantize: str = "none",
) -> dict:
    """The drafter's graphs, embedding table and vocabulary into `folder` (beside its weights), each graph's
    parity against the fp32 eager pass checked; -> its manifest entry (the caller adds the tree and the training
    key). A graph further off than its format's PARITY_TOLERANCE is refused."""
    fields = {"masks": drafter.num_masks, "rows": rows, "capacity": capacity}
    module, inputs = DraftPass(drafter.eval(), rows), example_inputs(drafter, rows, capacity)
    return GRAPH.export(module, inputs, fields, embed, engines, folder, quantize)


def max_difference(graph, eager, hidden: int, vocab: int, passes: int = 6) -> float:
    """Both passes over the same sequence of 1..rows real rows (random states and tokens): the largest logit
    difference, relative to the largest eager logit."""
    generator = np.random.default_rng(0)
    graph.reset()
    eager.reset()
    worst, position = 0.0, 20
    for index in range(passes):
        real = 1 + index % graph.rows
        states = generator.standard_normal((real, hidden)).astype(np.float32)
        tokens = generator.integers(0, vocab, real).tolist()
        expected = eager.run(states, tokens, position)
        error = np.abs(graph.run(states, tokens, position) - expected).max() / max(np.abs(expected).max(), 1e-6)
        worst = max(worst, float(error))
        position += real
    return worst


GRAPH = PassGraph("parallelspec", OUTPUT_NAMES, GraphParallelPass, max_difference)
