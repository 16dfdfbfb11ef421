"""Several sequences' steps in one call: a batched step graph (contract.batch_method(B, T)) verifies B sequences'
trees of T rows each, every sequence on its own backend (StaticGraphBackend.with_own_cache: its own cache, the shared
runner). The linears see all B*T rows at once, so B sequences share each weight load; attention runs per
sequence on its own cache, and row b*T + t equals row t of sequence b's own step call bit for bit, so each
sequence decodes exactly what it decodes alone.

The host pads a batch of fewer sequences with a scratch backend (its rows ignored), sends each sequence's pending
commit as its row of `commit`, and hands each sequence its StepOutput as its own step call would build it
(StaticGraphBackend.step_output: logits, anchors for the streams after the commit, the rows pending the commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from streamfuse.runtime.artifact.contract import batch_inputs, batch_method
from streamfuse.runtime.backends.base import StepOutput
from streamfuse.runtime.backends.static_graph import StaticGraphBackend
from streamfuse.runtime.speculation.tree import TreeSpec

ROOT_ONLY = TreeSpec(())  # a decode row's tree (T = 1), and a scratch sequence's
SCRATCH_LENGTH = 1  # a scratch sequence's cache_len: one real row before its ignored ones


@dataclass(frozen=True)
class BatchItem:
    """One sequence's part of a batched step: the draft its own step call would verify."""

    backend: StaticGraphBackend
    tokens: Sequence[int]
    tree: TreeSpec | None
    with_streams: bool


def batch_rows(backend: object, tree: TreeSpec | None) -> int | None:
    """The rows T a step of `tree` takes in a batched step on `backend`, None where it has no batched steps."""
    spec = getattr(backend, "spec", None)
    if spec is None or not spec.engine_cache or not getattr(spec, "batches", ()):
        return None
    try:
        return backend.step_rows(tree)
    except ValueError:
        return None


def batch_shapes(spec, count: int, rows: int) -> list[tuple[int, int]]:
    """How `count` sequences of `rows` rows split into batched calls: the largest batch first, then the smallest
    that holds the rest; [] where a call would carry one sequence (its own step is as fast)."""
    largest = max((b for b, t in spec.batches if t == rows), default=0)
    shapes = []
    while count > 1 and largest > 1:
        shape = spec.batch(min(count, largest), rows)
        shapes.append(shape)
        count -= min(count, shape[0])
    return shapes


def batched_step(items: Sequence[BatchItem], shape: tuple[int, int], scratch: StaticGraphBackend) -> list[StepOutput]:
    """One call of batch_method(*shape) for `items` (at most B of them, each of T rows) -> each one's StepOutput.
    A call that raises leaves every sequence's cache unknown (each refuses calls until its reset)."""
    sequences, rows = shape
    if not 0 < len(items) <= sequences:
        raise ValueError(f"a batched step of {sequences} sequences takes 1 to {sequences}, got {len(items)}")
    first = items[0].backend
    ids = [item.backend.step_ids(item.tokens, item.tree) for item in items]
    if any(len(row) != rows for row in ids):
        raise ValueError(f"a batched step of {rows} rows per sequence got drafts of {[len(r) for r in ids]} rows")
    pads = sequences - len(items)
    backends = [item.backend for item in items]
    trees = [item.tree or ROOT_ONLY for item in items] + [ROOT_ONLY] * pads
    tree, depths = batch_inputs(trees, rows)
    lengths = [b.length for b in backends] + [SCRATCH_LENGTH] * pads
    caches = [array for b in backends + [scratch] * pads for array in (b.keys, b.values)]
    commits = [b.take_commit() for b in backends] + [scratch.take_commit()] * pads
    method = batch_method(sequences, rows)
    inputs = [
        np.array([sum(ids, []) + [0] * (rows * pads)], dtype=np.int64),
        np.array(lengths, dtype=np.int64),
        tree,
        depths,
        *caches,
        np.stack(commits),
    ]
    try:
        logits, anchor, hidden = first.runner.run(method, inputs)
    except BaseException as error:
        for backend in backends:
            backend.call_failed(method, error)
        raise
    outputs = []
    for index, item in enumerate(items):
        count = item.tree.num_nodes if item.tree is not None else 1
        part = slice(index * rows, index * rows + count)
        out = {"logits": np.array(logits[part]), "anchor": np.array(anchor[part]), "hidden": np.array(hidden[part])}
        outputs.append(item.backend.step_output(out, item.tree, item.with_streams))
    return outputs
