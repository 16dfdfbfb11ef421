"""Falcon's drafter pass as one static graph (ExecuTorch .pte, ONNX), run by its graph pass (graph_pass.py beside
this file; the writers and the check it shares with ParallelSpec's: methods/fused/graph.py):

    draft(states [R, H], embeds [R, H], positions [R], read [k], mask [R, C + R], keys [1, kv, C, d],
          values [1, kv, C, d]) -> features [k, H], logits [k, D], new_keys [1, kv, R, d], new_values

R rows (real rows or a block of predicted ones, padded), a cache of C slots (the real rows, then scratch for
later passes' blocks); the mask is the host's (its drafter's block_visibility); the norm and head run on the
`read` rows only (the block).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.falcon.graph_pass import GraphFalconPass
from streamfuse.methods.falcon.model import FalconModel
from streamfuse.methods.fused.graph import PassGraph, PassModule

OUTPUT_NAMES = ["features", "logits", "new_keys", "new_values"]


class FalconPassModule(PassModule):
    def draft(self, states, embeds, positions, read, mask, cache: StepKeyValues) -> tuple[torch.Tensor, ...]:
        rows = self.drafter.fused(states[None], embeds[None])
        hidden = self.drafter.states(rows, positions[None], mask[None, None], cache)[0][read]
        return hidden, self.drafter.head(hidden)


def example_inputs(drafter: FalconModel, rows: int, slots: int) -> tuple[torch.Tensor, ...]:
    attention = drafter.layer.self_attn
    cache = torch.zeros(1, attention.config.num_key_value_heads, slots, attention.head_dim)
    hidden = drafter.hidden_size
    return (
        torch.zeros(rows, hidden),
        torch.zeros(rows, hidden),
        torch.arange(rows),
        torch.arange(rows - drafter.block, rows),
        torch.zeros(rows, slots + rows),
        cache,
        cache.clone(),
    )


def export_drafter(
    drafter: FalconModel,
    embed: nn.Module,
    rows: int,
    capacity: int,
    max_passes: int,
    engines: list[str],
    folder: Path,
    quantize: str = "none",
) -> dict:
    """The drafter's graphs, embedding table and vocabulary into `folder` (beside its weights), each graph's
    parity against its eager twin checked (PARITY_TOLERANCE) -> its manifest entry (the caller adds the tree and
    the training key). The cache holds `capacity` real rows, then scratch for max_passes - 1 blocks."""
    slots = capacity + (max_passes - 1) * drafter.block
    fields = {"block": drafter.block, "rows": rows, "capacity": capacity, "max_passes": max_passes, "slots": slots}
    module, inputs = FalconPassModule(drafter.eval(), rows), example_inputs(drafter, rows, slots)
    return GRAPH.export(module, inputs, fields, embed, engines, folder, quantize)


def max_difference(graph, eager, hidden: int, vocab: int, steps: int = 4) -> float:
    """Both passes over the same steps (random real rows, 1..R + 1 of them so that some take two calls, then a
    block pass in scratch): the largest logit or feature difference, relative to the largest eager value."""
    generator = np.random.default_rng(0)
    graph.reset()
    eager.reset()
    worst, slot, position = 0.0, 0, 20
    for index in range(steps):
        real = graph.block + index % (graph.rows + 2 - graph.block)
        states = generator.standard_normal((real, hidden)).astype(np.float32)
        tokens = generator.integers(0, vocab, real).tolist()
        rows = (states, tokens, position, slot)
        expected = eager.run(*rows)
        worst = max(worst, _relative(graph.run(*rows), expected))
        block = (expected[0], generator.integers(0, vocab, graph.block).tolist(), position + real, slot + real)
        worst = max(worst, _relative(graph.run(*block), eager.run(*block)))
        slot, position = slot + real, position + real
    return worst


def _relative(got: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...]) -> float:
    return max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6)) for a, b in zip(got, expected))


GRAPH = PassGraph("falcon", OUTPUT_NAMES, GraphFalconPass, max_difference)
