"""Falcon's drafter pass on an exported graph (methods/falcon/graph.py), a FalconPass for methods/falcon/drafter.py
(methods/fused/graph_pass.py has the host side it shares with ParallelSpec's, the graph's inputs included).

The cache's C slots hold the real rows, then scratch slots for the blocks of later passes
(C = capacity + (max_passes - 1) k). A call takes R rows at most: a longer run of rows goes in several
calls, the block (the last k rows) in the last one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamfuse.methods.falcon.drafter import block_visibility
from streamfuse.methods.fused.graph_pass import GraphDrafterPass
from streamfuse.runtime.backends.base import CapacityError


class GraphFalconPass(GraphDrafterPass):
    ENTRY = ("block", "rows", "slots")

    def __init__(
        self,
        runner,
        embedding: np.ndarray,
        vocab_ids: np.ndarray,
        block: int,
        rows: int,
        slots: int,
        cache_shape: tuple[int, int],
        vocab_size: int,
    ):
        if rows < block:
            raise ValueError(f"a Falcon pass of {rows} rows cannot hold a block of {block}")
        super().__init__(runner, embedding, vocab_ids, rows, slots, cache_shape, vocab_size)
        self.block = block

    def run(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        count = len(tokens)
        if slot + count > self.slots:
            raise CapacityError(
                f"falcon's drafter cache is full: {slot} + {count} rows > {self.slots} (the build's "
                f"falcon.capacity); lower max_new_tokens or rebuild with a larger one"
            )
        head = max(0, count - self.rows)  # rows before the last call's, in calls of R
        for start in range(0, head, self.rows):
            end = min(start + self.rows, head)
            self._call(states[start:end], tokens[start:end], position + start, slot + start, 1)
        return self._call(states[head:], tokens[head:], position + head, slot + head, self.block)

    def _call(self, states: np.ndarray, tokens: Sequence[int], position: int, slot: int, block: int):
        real, rows, k = len(tokens), self.rows, self.block
        positions = np.concatenate(
            [np.arange(position, position + real), np.full(rows - real, position + real - 1)]
        ).astype(np.int64)
        read = np.clip(np.arange(real - k, real), 0, None).astype(np.int64)
        visible = block_visibility(slot, self.slots, real, rows, block)
        features, logits = self.call([*self.rows_in(states, tokens), positions, read], visible, slot, real)
        return features, logits
