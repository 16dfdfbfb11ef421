"""Preallocated key/value cache with commit-time compaction.

A step writes the K/V of all its main tokens (every tree node) into scratch rows right after
the committed length, so attention reads one contiguous view and nothing is reallocated. After
acceptance, `commit` moves the accepted nodes' rows down to close the gaps:

    rows:   [ committed (length) | step scratch: node 0, node 1, ..., node T-1 | free ]
    commit([0, 2, 5]) -> rows length+0, +1, +2 take nodes 0, 2, 5; length += 3
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamfuse.adapters.msa import KeyValues
from streamfuse.runtime.backends.base import CapacityError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)  # batch 1
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        self.pending = 0  # scratch rows written by the last step, not yet committed

    def reset(self) -> None:
        self.length = self.pending = 0

    def writer(self, main_len: int) -> "CacheWriter":
        if self.length + main_len > self.capacity:
            raise CapacityError(f"KV cache full: {self.length} committed + {main_len} new > capacity {self.capacity}; "
                                f"reset the backend with a larger capacity or lower max_new_tokens")
        self.pending = main_len
        return CacheWriter(self, main_len)

    def truncate(self, length: int) -> None:
        """Forget committed rows from `length` on (a draft model's rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length}: the cache holds {self.length} committed rows")
        self.length = length
        self.pending = 0

    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the scratch rows of `nodes` (indices into the last step's tokens, ascending)."""
        if any(not 0 <= n < self.pending for n in nodes) or list(nodes) != sorted(set(nodes)):
            raise ValueError(f"commit nodes {list(nodes)} must be ascending, distinct and < {self.pending}")
        start = self.length
        if list(nodes) != list(range(len(nodes))):
            index = torch.tensor(nodes, device=self.keys.device) + start
            # index_select copies first, so overlapping source/target rows are safe.
            self.keys[:, :, :, start : start + len(nodes)] = self.keys.index_select(3, index)
            self.values[:, :, :, start : start + len(nodes)] = self.values.index_select(3, index)
        self.length += len(nodes)
        self.pending = 0


class CacheWriter(KeyValues):
    """The model's K/V provider for one step: writes main-token K/V into scratch rows in place."""

    def __init__(self, cache: KVCache, main_len: int):
        super().__init__(main_len)
        self.cache = cache

    def _store(self, layer, keys, values):
        start, end = self.cache.length, self.cache.length + self.main_len
        self.cache.keys[layer, :, :, start:end] = keys
        self.cache.values[layer, :, :, start:end] = values
        return self.cache.keys[layer, :, :, :end], self.cache.values[layer, :, :, :end]
