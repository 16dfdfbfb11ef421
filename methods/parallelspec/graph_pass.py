"""ParallelSpec's drafter pass on an exported graph (methods/parallelspec/graph.py), a ParallelPass for
methods/parallelspec/drafter.py (methods/fused/graph_pass.py has the host side it shares with Falcon's).

A pass takes R real rows at most, so more pending rows (after plain steps) go in several passes, the last one's
logits kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from streamfuse.methods.fused.graph_pass import GraphDrafterPass
from streamfuse.methods.parallelspec.drafter import pass_visibility
from streamfuse.runtime.backends.base import CapacityError


class GraphParallelPass(GraphDrafterPass):
    ENTRY = ("masks", "rows", "capacity")

    def __init__(
        self,
        runner,
        embedding: np.ndarray,
        vocab_ids: np.ndarray,
        masks: int,
        rows: int,
        capacity: int,
        cache_shape: tuple[int, int],
        vocab_size: int,
    ):
        super().__init__(runner, embedding, vocab_ids, rows, capacity, cache_shape, vocab_size)
        self.masks, self.capacity = masks, capacity
        self.length = 0

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def run(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        logits = None
        for start in range(0, len(tokens), self.rows):
            logits = self._pass(states[start : start + self.rows], tokens[start : start + self.rows], position + start)
        return logits

    def _pass(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        real, rows, masks = len(tokens), self.rows, self.masks
        if self.length + real > self.capacity:
            raise CapacityError(
                f"parallelspec's drafter cache is full: {self.length} + {real} rows > "
                f"{self.capacity} (the build's parallelspec.capacity); lower max_new_tokens or rebuild "
                f"with a larger one"
            )
        last = position + real - 1
        positions = np.concatenate(
            [np.arange(position, position + real), np.full(rows - real, last), last + np.arange(1, masks + 1)]
        ).astype(np.int64)
        read = np.concatenate([[real - 1], rows + np.arange(masks)]).astype(np.int64)
        visible = pass_visibility(self.length, self.capacity, real, rows, masks)
        (logits,) = self.call([*self.rows_in(states, tokens), positions, read], visible, self.length, real)
        self.length += real
        return logits
