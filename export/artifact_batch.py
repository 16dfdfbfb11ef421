"""The batched steps' parity (ArtifactBuilder's gate: export/artifact_parity.py): one batched call of each
batch_step_{B}x{T} against its sequences' own calls (step_T, decode for T = 1) on the same engine, from the same
caches. Row b * T + t of every output and each sequence's cache after the call must equal the single call's, bit
for bit; the sequences differ in cache_len, tree and pending commit, and the last is a scratch one (the root
alone), as the host pads a batch. A graph that mixes sequences or moves another's rows refuses the artifact."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from streamfuse.export.verify import ParityError
from streamfuse.runtime.artifact.contract import GraphSpec, batch_inputs, batch_method, bucket_method, tree_inputs
from streamfuse.runtime.backends.static_graph import GraphRunner
from streamfuse.runtime.speculation.tree import MAX_DEPTH, TreeSpec


@dataclass(frozen=True)
class BatchCase:
    """One batched call's inputs: `sequences` sequences of `rows` rows, each with its own cache (made by cache(b))."""

    spec: GraphSpec
    rows: int
    ids: np.ndarray  # [1, B * T]
    cache_len: np.ndarray  # [B]
    trees: tuple[TreeSpec, ...]
    commit: np.ndarray  # [B, max_nodes]
    seed: int

    @property
    def sequences(self) -> int:
        return len(self.trees)

    @property
    def method(self) -> str:
        return batch_method(self.sequences, self.rows)

    def cache(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence `index`'s cache before the call (the same arrays every time): random rows over the span the call
        reads and moves, zeros after them (pages the call never touches)."""
        spec = self.spec
        shape = (spec.num_layers, spec.num_kv_heads, spec.capacity, spec.head_dim)
        used = min(int(self.cache_len[index]) + spec.max_nodes, spec.capacity)
        rng = np.random.default_rng((self.seed, index))
        keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        keys[:, :, :used] = rng.standard_normal((*shape[:2], used, shape[3]), np.float32)
        values[:, :, :used] = rng.standard_normal((*shape[:2], used, shape[3]), np.float32)
        return keys, values


def batch_case(spec: GraphSpec, sequences: int, rows: int, seed: int = 0) -> BatchCase:
    """Sequences of different lengths and trees (a full bucket, a chain with pad rows), every other one with a
    pending commit of two nodes, the last a scratch sequence (the root alone, at the cache's start)."""
    rng = np.random.default_rng(seed)
    gamma = max(1, min(spec.num_streams, rows - 1, MAX_DEPTH))
    shapes = (TreeSpec.filling(rows, gamma), TreeSpec.chain(min(max(rows - 2, 1), MAX_DEPTH))) if rows > 1 else ()
    trees = [shapes[index % 2] if shapes else TreeSpec(()) for index in range(sequences - 1)] + [TreeSpec(())]
    room = spec.capacity - rows - spec.max_nodes
    cache_len = np.array([min(6 + 5 * index, room) for index in range(sequences - 1)] + [1], dtype=np.int64)
    commit = np.full((sequences, spec.max_nodes), -1, dtype=np.int64)
    for index in range(0, sequences - 1, 2):
        nodes = [0, min(2, spec.max_nodes - 1)] if spec.max_nodes > 2 else [0]
        if cache_len[index] >= len(nodes) + nodes[-1]:
            commit[index, : len(nodes)] = nodes
    ids = rng.integers(0, spec.vocab_size, (1, sequences * rows), dtype=np.int64)
    return BatchCase(spec, rows, ids, cache_len, tuple(trees), commit, seed)


def batched_call(runner: GraphRunner, case: BatchCase) -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """The batched call's outputs (copies) and each sequence's cache after it."""
    tree, depths = batch_inputs(case.trees, case.rows)
    caches = [case.cache(index) for index in range(case.sequences)]
    flat = [tensor for pair in caches for tensor in pair]
    outputs = runner.run(case.method, [case.ids, case.cache_len, tree, depths, *flat, case.commit])
    return [np.array(out, copy=True) for out in outputs], caches


def single_calls(
    runner: GraphRunner, case: BatchCase
) -> Iterator[tuple[list[np.ndarray], tuple[np.ndarray, np.ndarray]]]:
    """Each sequence's own call (step_T; decode for T = 1) from the same cache: its outputs and its cache after."""
    rows = case.rows
    for index, tree in enumerate(case.trees):
        keys, values = case.cache(index)
        ids, length = case.ids[:, index * rows : (index + 1) * rows], case.cache_len[index : index + 1]
        if rows == 1:
            outputs = runner.run("decode", [ids, length, keys, values, case.commit[index]])
        else:
            visible, depths, _ = tree_inputs(tree, rows)
            inputs = [ids, length, visible, depths, keys, values, case.commit[index]]
            outputs = runner.run(bucket_method("step", rows), inputs)
        yield [np.array(out, copy=True) for out in outputs], (keys, values)


def batch_parity(runner: GraphRunner, spec: GraphSpec, seed: int = 0) -> dict[str, dict]:
    """{batched method: {"outputs": rows equal, "caches": caches equal}} for every batched step of `spec`."""
    results = {}
    for sequences, rows in spec.batches:
        case = batch_case(spec, sequences, rows, seed)
        outputs, caches = batched_call(runner, case)
        same_rows = same_caches = True
        for index, (own, (keys, values)) in enumerate(single_calls(runner, case)):
            span = slice(index * rows, (index + 1) * rows)
            same_rows &= all(np.array_equal(out[span], want) for out, want in zip(outputs, own))
            same_caches &= np.array_equal(caches[index][0], keys) and np.array_equal(caches[index][1], values)
        results[case.method] = {"outputs": bool(same_rows), "caches": bool(same_caches)}
    return results


def check_batches(backend: str, result: dict) -> None:
    """ParityError naming the first batched step whose rows or caches differ from its sequences' own calls."""
    for method, checks in (result.get("batches") or {}).items():
        failed = [name for name, same in checks.items() if not same]
        if failed:
            raise ParityError(
                f"parity failed on {backend}: {method}'s {' and '.join(failed)} differ from its sequences' own "
                f"calls; the artifact was not installed"
            )
