"""Falcon's drafter pass on an exported graph (export/falcon_graph.py), a FalconPass for runtime/falcon_drafter.py:
numpy on the host, no torch for ONNX Runtime. The graph's inputs are ParallelSpec's (parallel_graph.INPUT_NAMES).

The cache is the host's [1, kv, C, d] pair: the real rows, then scratch slots for the blocks of later passes
(C = capacity + (max_passes - 1) k). A call takes R rows at most: a longer run of rows goes in several
calls, the block (the last k rows) in the last one. Pad rows and unseen slots are masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from streamfuse.runtime.backends.base import CapacityError
from streamfuse.runtime.backends.parallel_graph import open_files
from streamfuse.runtime.falcon_drafter import block_visibility


class GraphFalconPass:
    def __init__(self, session, embedding: np.ndarray, vocab_ids: np.ndarray, block: int, rows: int, slots: int,
                 cache_shape: tuple[int, int], vocab_size: int):
        if rows < block:
            raise ValueError(f"a Falcon pass of {rows} rows cannot hold a block of {block}")
        self.session, self.embedding, self.vocab_ids = session, embedding, vocab_ids
        self.block, self.rows, self.slots, self.vocab_size = block, rows, slots, vocab_size
        self.kv_heads, self.head_dim = cache_shape
        self.keys = self.values = None

    @classmethod
    def open(cls, folder: Path, entry: dict, engine: str, vocab_size: int, threads: int | None = None) -> "GraphFalconPass":
        """The pass of `engine` in the drafter folder, as its manifest entry records it."""
        session, embedding, vocab_ids = open_files(folder, entry, engine, threads)
        return cls(session, embedding, vocab_ids, entry["block"], entry["rows"], entry["slots"], tuple(entry["cache"]),
                   vocab_size)

    def reset(self) -> None:
        shape = (1, self.kv_heads, self.slots, self.head_dim)
        self.keys, self.values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def run(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        count = len(tokens)
        if slot + count > self.slots:
            raise CapacityError(f"falcon's drafter cache is full: {slot} + {count} rows > {self.slots} (the build's "
                                f"falcon.capacity); lower max_new_tokens or rebuild with a larger one")
        head = max(0, count - self.rows)  # rows before the last call's, in calls of R
        for start in range(0, head, self.rows):
            end = min(start + self.rows, head)
            self._call(states[start:end], tokens[start:end], position + start, slot + start, 1)
        return self._call(states[head:], tokens[head:], position + head, slot + head, self.block)

    def _call(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int, block: int):
        real, rows, k = len(tokens), self.rows, self.block
        padded = np.zeros((rows, states.shape[1]), np.float32)
        padded[:real] = states
        embeds = np.zeros_like(padded)
        embeds[:real] = self.embedding[np.asarray(tokens)]
        positions = np.concatenate([np.arange(position, position + real),
                                    np.full(rows - real, position + real - 1)]).astype(np.int64)
        read = np.clip(np.arange(real - k, real), 0, None).astype(np.int64)
        visible = block_visibility(slot, self.slots, real, rows, block)
        mask = np.where(visible, np.float32(0), np.float32(np.finfo(np.float32).min))
        features, logits, new_keys, new_values = self.session.run(
            "draft", [padded, embeds, positions, read, mask, self.keys, self.values])
        self.keys[:, :, slot : slot + real] = new_keys[:, :, :real]
        self.values[:, :, slot : slot + real] = new_values[:, :, :real]
        return np.array(features, dtype=np.float32), np.array(logits, dtype=np.float32)
