"""KV cache compaction against literal tables."""

import pytest
import torch

from streamfuse.runtime.kv_cache import CapacityError, KVCache


def rows(cache: KVCache) -> list[float]:
    return cache.keys[0, 0, 0, :, 0].tolist()


def write_step(cache: KVCache, values: list[float]) -> None:
    writer = cache.writer(len(values))
    keys = torch.tensor(values)[None, None, :, None]  # [B=1, heads=1, T, d=1]
    all_keys, _ = writer.update(keys, keys.clone(), 0)
    assert all_keys.shape[2] == cache.length + len(values)


def test_commit_compacts_accepted_rows():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=1, capacity=8)
    write_step(cache, [10, 11, 12])
    cache.commit([0, 1, 2])  # prefill: keep all
    write_step(cache, [20, 21, 22, 23, 24])  # a 5-node tree in scratch rows 3..7
    assert rows(cache) == [10, 11, 12, 20, 21, 22, 23, 24]
    cache.commit([0, 2, 4])  # accepted path root -> node 2 -> node 4
    assert cache.length == 6
    assert rows(cache)[:6] == [10, 11, 12, 20, 22, 24]
    write_step(cache, [30])
    cache.commit([0])
    assert rows(cache)[:7] == [10, 11, 12, 20, 22, 24, 30]


def test_capacity_and_bad_commits_are_clear_errors():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=1, capacity=4)
    write_step(cache, [1, 2, 3])
    cache.commit([0, 1, 2])
    with pytest.raises(CapacityError, match="capacity 4"):
        cache.writer(2)
    write_step(cache, [4])
    with pytest.raises(ValueError, match="ascending"):
        cache.commit([1])
