"""Falcon's drafter pass as one static graph (ExecuTorch .pte, ONNX), run by runtime/backends/falcon_graph.py:

    draft(states [R, H], embeds [R, H], positions [R], read [k], mask [R, C + R], keys [1, kv, C, d],
          values [1, kv, C, d]) -> features [k, H], logits [k, D], new_keys [1, kv, R, d], new_values

R rows (real rows or a block of predicted ones, padded), a cache of C slots (the real rows, then scratch for
later passes' blocks); the mask is the host's (runtime/falcon_drafter.py block_visibility); the norm and
head run on the `read` rows only (the block). Inputs as ParallelSpec's graph (export/parallel_graph.py, whose
ONNX writer, embedding table and eager session this reuses).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.falcon import FalconModel
from streamfuse.adapters.msa import StepKeyValues
from streamfuse.export.parallel_graph import (EMBEDDING_FILE, PARITY_TOLERANCE, VOCAB_FILE, EagerSession, quantized,
                                              write_embedding, write_passes)

OUTPUT_NAMES = ["features", "logits", "new_keys", "new_values"]


class FalconPassModule(nn.Module):
    def __init__(self, drafter: FalconModel, rows: int):
        super().__init__()
        self.drafter, self.rows = drafter, rows

    def forward(self, states, embeds, positions, read, mask, keys, values):
        cache = StepKeyValues(1, self.rows, [(keys, values)])
        rows = self.drafter.fused(states[None], embeds[None])
        hidden = self.drafter.states(rows, positions[None], mask[None, None], cache)[0][read]
        new_keys, new_values = cache.new[0]
        return hidden, self.drafter.head(hidden), new_keys, new_values


def example_inputs(drafter: FalconModel, rows: int, slots: int) -> tuple[torch.Tensor, ...]:
    attention = drafter.layer.self_attn
    cache = torch.zeros(1, attention.config.num_key_value_heads, slots, attention.head_dim)
    hidden = drafter.hidden_size
    return (torch.zeros(rows, hidden), torch.zeros(rows, hidden), torch.arange(rows),
            torch.arange(rows - drafter.block, rows), torch.zeros(rows, slots + rows), cache, cache.clone())


def export_graphs(drafter: FalconModel, rows: int, slots: int, engines: list[str], folder: Path,
                  quantize: str = "none") -> dict[str, str]:
    """Write the pass for each engine into `folder`; returns engine -> file. quantize "int8": ExecuTorch's pass
    gets torchao's int8 weights (export/parallel_graph.py says why ONNX Runtime's stays fp32)."""
    return write_passes(FalconPassModule(drafter.eval(), rows), example_inputs(drafter, rows, slots), OUTPUT_NAMES,
                        engines, folder, quantize, "falcon")


def export_drafter(drafter: FalconModel, embed: nn.Module, rows: int, capacity: int, max_passes: int,
                   engines: list[str], folder: Path, quantize: str = "none") -> dict:
    """The drafter's graphs, embedding table and vocabulary into `folder` (beside its weights), each graph's
    parity against its eager twin checked (PARITY_TOLERANCE) -> its manifest entry."""
    from streamfuse.runtime.backends.falcon_graph import GraphFalconPass
    from streamfuse.runtime.backends.parallel_graph import OnnxDraftSession
    from streamfuse.runtime.backends.sessions import ExecuTorchSession

    folder, slots = Path(folder), capacity + (max_passes - 1) * drafter.block
    write_embedding(embed, folder)
    np.save(folder / VOCAB_FILE, drafter.vocab_ids.cpu().numpy())
    files = export_graphs(drafter, rows, slots, engines, folder, quantize)
    attention = drafter.layer.self_attn
    entry = {"block": drafter.block, "rows": rows, "capacity": capacity, "max_passes": max_passes, "slots": slots,
             "vocab": len(drafter.vocab_ids), "cache": [attention.config.num_key_value_heads, attention.head_dim],
             "graphs": files, "embedding": EMBEDDING_FILE, "vocab_file": VOCAB_FILE,
             "formats": {engine: quantize if engine == "executorch" else "none" for engine in files}}
    embedding = np.load(folder / EMBEDDING_FILE, mmap_mode="r")

    def opened(session) -> GraphFalconPass:
        return GraphFalconPass(session, embedding, drafter.vocab_ids.numpy(), drafter.block, rows, slots,
                               tuple(entry["cache"]), len(embedding))

    module = FalconPassModule(drafter.eval(), rows)
    parity = {}
    for engine, file in files.items():
        session = ExecuTorchSession(folder / file, 1) if engine == "executorch" else OnnxDraftSession(folder / file, 1)
        reference = opened(EagerSession(quantized(module, quantize if engine == "executorch" else "none")))
        error = max_difference(opened(session), reference, drafter.hidden_size, len(embedding))
        if not error <= PARITY_TOLERANCE:
            raise ValueError(f"falcon's {engine} drafter graph is off its eager twin by {error:.3g} of the largest "
                             f"logit > {PARITY_TOLERANCE}: the export is wrong; the artifact keeps no such drafter")
        parity[engine] = float(f"{error:.3g}")
    return {**entry, "parity": parity}


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
