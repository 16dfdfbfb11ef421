"""The backend over the graphs' functions: exported static-shape graphs (ExecuTorch, ONNX Runtime, Core ML)
and the same functions run eagerly by torch (export/eager.py). The graphs' names, tensors and who writes the cache
are the contract's (runtime/artifact/contract.py).

The KV cache [L, kv_heads, C, d] is one buffer per K and V, allocated here and handed to every call. Who
writes it depends on the graphs (GraphSpec.engine_cache, the manifest's kv_layout owner):
- "engine" (ExecuTorch, ONNX Runtime: the exact kernel's graphs): a call writes its own rows into slots
  cache_len.. in place, and moves the rows the host accepted from the previous call down into place, by index
  (its `commit` input): no K/V rows come out of a call and the host never copies one;
- "host" (Core ML, the torch runner): a call returns its rows (new_keys, new_values) and the host copies the
  accepted ones in.
This class also owns chunked prefill, running the streams of the last accepted node after the commit, and
pruning a tree. A call that raises leaves the cache unknown (the engine may have moved rows before failing): the
backend then refuses every call until a reset, which each generation starts with (runtime/request/decode.py), so a
failure
never leaves a pending commit to be applied twice. A `GraphRunner` is the only engine-specific part: it runs one named
method on a list of arrays (numpy; the torch runner keeps the cache as tensors on its device).
"""

from __future__ import annotations

import copy
import functools
import mmap
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

import numpy as np

from streamfuse.runtime.artifact.contract import (
    NEW_ROWS,
    GraphSpec,
    bucket_method,
    output_names,
    tree_inputs,
)
from streamfuse.runtime.backends.base import (
    HEAD_LOGITS,
    HIDDEN,
    STREAM_STATES,
    CapacityError,
    EngineError,
    PruneConfig,
    StepOutput,
    process_peak_rss_bytes,
)
from streamfuse.runtime.speculation.tree import TreeSpec


class GraphRunner(Protocol):
    """Runs the graphs' methods. A runner that also runs pruned_step says so with a true `prunes` attribute
    (the torch runner; exported graphs have none)."""

    name: str  # engine and where it runs, e.g. "onnxruntime:CPUExecutionProvider"

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Run one exported method; outputs in the manifest's order."""


def interleaved_call_times(
    calls: dict[Hashable, tuple[GraphRunner, str, list[np.ndarray]]],
    rounds: int,
    warmup: int,
    progress: Callable[[Iterable], Iterable] = iter,
) -> dict[Hashable, list[float]]:
    """Seconds of each call (key -> runner, method, inputs) over `rounds` rounds after `warmup` untimed
    ones; each round runs every call once, so all of them see the same conditions."""
    samples = {key: [] for key in calls}
    for round_ in progress(range(warmup + rounds)):
        for key, (runner, method, inputs) in calls.items():
            start = time.perf_counter()
            runner.run(method, inputs)
            if round_ >= warmup:
                samples[key].append(time.perf_counter() - start)
    return samples


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros in an anonymous mapping of their own, whose pages become resident only when written, 4 KiB at a
    time: a cache of C slots then costs the rows in use. (NumPy asks the kernel for transparent huge pages on large
    arrays, so one row written into each layer's slots would make a whole 2,048-slot cache resident: 90 MiB.)"""
    size = int(np.prod(shape)) * 4
    if size == 0:
        return np.zeros(shape, np.float32)
    mapping = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere small pages are the default
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, dtype=np.float32).reshape(shape)  # the array keeps the mapping alive


class StaticGraphBackend:
    """Backend protocol over a GraphRunner. Greedy steps run the tree's greedy_step, one call (unless
    use_greedy_step is False, or calibration found two calls faster for the tree's bucket: two_calls); otherwise,
    and for sampling, its `step` and then, after the commit, a `streams` call for the accepted node (the deferred
    schedule). A pruned step (a runner with pruned_step: the torch one) also returns each node's transition
    probability, and the host keeps the nodes keep_nodes allows. `zeros` allocates the cache (numpy, or the
    runner's device tensors)."""

    def __init__(
        self,
        runner: GraphRunner,
        spec: GraphSpec,
        device: str = "cpu",
        use_greedy_step: bool = True,
        zeros: Callable[[tuple[int, ...]], object] = lazy_zeros,
    ):
        self.runner = runner
        self.spec = spec
        self.use_greedy_step = use_greedy_step
        self.two_calls: frozenset[int] = frozenset()  # buckets whose greedy steps run step, then streams
        self.name = runner.name
        self.device = device
        self.num_streams = spec.num_streams
        self.vocab_size = spec.vocab_size
        self.max_positions = spec.capacity  # the artifact's context: a run must fit its static cache
        self._zeros = zeros
        self.keys = self.values = None
        if not spec.dynamic:
            self._allocate(spec.capacity)
        self._no_commit = np.full(spec.max_nodes or 0, -1, dtype=np.int64)
        self._empty()
        self._trees: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def checked(cls, runner: GraphRunner, spec: GraphSpec, device: str = "cpu") -> StaticGraphBackend:
        """The backend over a freshly opened runner, once check_in_place has passed."""
        backend = cls(runner, spec, device)
        backend.check_in_place()
        return backend

    def check_in_place(self) -> None:
        """Where the engine keeps the cache, one decode call of one token at slot 0 must write that row into the
        host's buffers: an engine (or provider) that copies its inputs would leave them as they were and give wrong
        tokens, not an error. The row is put back and the backend reset, so the check leaves no trace."""
        if not self.spec.engine_cache:
            return
        self.reset(1)
        before = [cache[:, :, 0].copy() for cache in (self.keys, self.values)]
        self._run("decode", [_ids([0]), self._length(), self.keys, self.values])
        written = [not np.array_equal(row, cache[:, :, 0]) for row, cache in zip(before, (self.keys, self.values))]
        self.keys[:, :, 0], self.values[:, :, 0] = before
        self.reset(1)
        if not all(written):
            raise EngineError(
                f"{self.name} did not write the KV cache in place (a one-token call at load left the "
                f"host's {'keys' if not written[0] else 'values'} unchanged): it copies its inputs, so "
                f"it would decode wrong tokens; run the artifact on CPU (ONNX Runtime's "
                f"CPUExecutionProvider, ExecuTorch with XNNPACK) or rebuild it with this version"
            )

    def step_rows(self, tree: TreeSpec | None) -> int:
        """A tree runs in its size bucket: the bucket's rows, pad rows included."""
        return self.spec.bucket(tree) if tree is not None else 1

    def with_own_cache(self) -> StaticGraphBackend:
        """A backend over the same runner (the graphs and weights loaded once) with a KV cache of its own, empty:
        what one sequence of a batch, or a chat, decodes on while others decode on theirs."""
        copied = copy.copy(self)
        copied.keys = copied.values = None
        if not self.spec.dynamic:
            copied._allocate(self.spec.capacity)
        copied._empty()
        return copied

    def reset(self, capacity: int) -> None:
        self._check_capacity(capacity)
        if self.spec.dynamic and (self.keys is None or self.keys.shape[2] < capacity):
            self._allocate(capacity)
        self._empty()

    def reserve(self, capacity: int) -> None:
        """Room for `capacity` positions, keeping the committed rows (a generation that starts from them)."""
        self._check_capacity(capacity)
        if self.spec.dynamic and (self.keys is None or self.keys.shape[2] < capacity):
            kept = (self.keys, self.values) if self.keys is not None else None
            self._allocate(capacity)
            if kept is not None and self.length:
                self.keys[:, :, : self.length] = kept[0][:, :, : self.length]
                self.values[:, :, : self.length] = kept[1][:, :, : self.length]

    def prefill(self, token_ids: Sequence[int], with_streams: bool) -> StepOutput:
        tokens = list(token_ids)
        chunk = len(tokens) if self.spec.dynamic else self.spec.prefill_chunk
        self._check_room(len(tokens))
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            ids = _ids(piece + [0] * (chunk - len(piece)))  # pad rows come last: causal, never seen
            out = self._run(
                "prefill", [ids, self._length(), self.keys, self.values, np.array([len(piece) - 1], dtype=np.int64)]
            )
            self._keep(out, range(len(piece)))
        logits, anchor, hidden = out["logits"], out["anchor"], out["hidden"]
        stream_logits, stream_states = self._stream_sources(lambda node: anchor) if with_streams else (None, None)
        return StepOutput(
            self.spec.full_logits(logits),
            stream_logits,
            extras=self._extras(hidden, stream_states, self._head_source(anchor, self.length - 1, [0])),
        )

    def step(
        self,
        tokens: Sequence[int],
        tree: TreeSpec | None,
        with_streams: bool,
        prune: PruneConfig | None = None,
        greedy: bool = False,
    ) -> StepOutput:
        if prune is not None and not getattr(self.runner, "prunes", False):
            raise ValueError("exported graphs have a static tree: pruning needs the torch backend (--backend torch)")
        ids = _ids(self.step_ids(tokens, tree))
        rows, count = ids.shape[1], len(tokens)
        if tree is None:
            method, inputs = "decode", [ids, self._length(), self.keys, self.values]
        else:
            visible, depths, parents = self._tree_inputs(tree, rows)
            if prune is not None:
                method, inputs = "pruned_step", [ids, self._length(), visible, depths, parents, self.keys, self.values]
            elif greedy and with_streams and self.one_call(tree):
                return self._greedy_step(
                    bucket_method("greedy_step", rows),
                    count,
                    [ids, self._length(), visible, depths, parents, self.keys, self.values],
                )
            else:
                method = bucket_method("step", rows)
                inputs = [ids, self._length(), visible, depths, self.keys, self.values]
        out = {name: t[..., :count, :] if t.ndim > 1 else t for name, t in self._run(method, inputs).items()}
        return self.step_output(out, tree, with_streams, prune)

    def step_ids(self, tokens: Sequence[int], tree: TreeSpec | None) -> list[int]:
        """A step's input ids, padded to its bucket's rows, once the tokens fit the tree and the rows the cache."""
        count = tree.num_nodes if tree is not None else 1
        if len(tokens) != count:
            raise ValueError(f"a step of {count} nodes takes {count} tokens, got {len(tokens)}")
        rows = self.step_rows(tree)
        self._check_room(rows)
        return list(tokens) + [0] * (rows - count)  # pad rows see only themselves

    def step_output(
        self, out: dict[str, np.ndarray], tree: TreeSpec | None, with_streams: bool, prune: PruneConfig | None = None
    ) -> StepOutput:
        """A step call's outputs (its nodes' rows: logits, anchor, hidden) -> what the decode loop reads; the rows
        wait for the commit, and the streams (if on) run after it for the accepted node (the deferred schedule)."""
        logits, anchors, hidden = out["logits"], out["anchor"], out["hidden"]
        self._pending = out
        stream_logits, stream_states = (
            self._stream_sources(lambda node: anchors[node : node + 1]) if with_streams else (None, None)
        )
        depths = tree.depths if tree is not None else [0]
        kept = keep_nodes(tree, out["transitions"].tolist(), prune) if prune is not None else None
        return StepOutput(
            self.spec.full_logits(logits),
            stream_logits,
            kept,
            extras=self._extras(hidden, stream_states, self._head_source(anchors, self.length, depths)),
        )

    def take_commit(self) -> np.ndarray:
        """The engine's pending commit for the next call, cleared so that no call sends it twice."""
        self._check_usable()
        commit, self._commit = self._commit, self._no_commit
        return commit

    def call_failed(self, method: str, error: BaseException) -> None:
        """A call that took this backend's commit raised: its cache is unknown until a reset."""
        self._failed = f"its last call ({method}) raised {type(error).__name__}, so its KV cache is unknown"
        self._pending = None

    def _tree_inputs(self, tree: TreeSpec, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tree_inputs, built once per tree shape (the lookup branch fills nodes, it does not change them)."""
        key = (tree.paths, rows)
        if key not in self._trees:
            self._trees[key] = tree_inputs(tree, rows)
        return self._trees[key]

    def one_call(self, tree: TreeSpec) -> bool:
        """Whether a greedy step of `tree` runs as its bucket's greedy_step graph (one call)."""
        return self.use_greedy_step and self.spec.drafts_from(tree) and self.spec.bucket(tree) not in self.two_calls

    def use_two_calls(self, trees: Sequence[TreeSpec]) -> None:
        """Greedy steps of these trees' buckets run step, then streams (where calibration timed that faster)."""
        self.two_calls = frozenset(self.spec.bucket(tree) for tree in trees)

    def stream_schedule(self, tree: TreeSpec) -> str:
        """Where a greedy step of `tree` runs its streams (its bucket's greedy_step schedule), else deferred."""
        return self.spec.schedule(self.spec.bucket(tree)) if self.one_call(tree) else "deferred"

    def commit(self, nodes: Sequence[int]) -> None:
        self._check_usable()
        if self._pending is None:
            raise RuntimeError("commit without a step")
        self._keep(self._pending, nodes)
        self._pending = None

    def rollback(self, length: int) -> None:
        self._check_usable()
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length}: the cache holds {self.length} committed rows")
        # A pending engine commit moves rows into slots base.. (base = length - its count): keep the moves below
        # the new length.
        moves = int((self._commit >= 0).sum())
        kept = max(0, length - (self.length - moves))
        self._commit = self._commit.copy()
        self._commit[kept:] = -1
        self.length = length  # the graphs attend to rows below cache_len only
        self._pending = None

    def peak_memory_bytes(self) -> int | None:
        return process_peak_rss_bytes()

    # --- helpers ----------------------------------------------------------------------------
    def _empty(self) -> None:
        """No committed rows, nothing pending, usable again."""
        self.length = 0
        self._pending = None
        self._commit = self._no_commit  # the engine's pending commit (COMMIT_INPUT), sent with the next call
        self._failed: str | None = None  # why the cache is unknown (a call raised) until the next reset

    def _check_capacity(self, capacity: int) -> None:
        if not self.spec.dynamic and capacity > self.spec.capacity:
            raise CapacityError(
                f"a run needs {capacity} KV positions but the artifact was exported with capacity "
                f"{self.spec.capacity}; lower max_new_tokens or rebuild with a larger "
                f"--set export.capacity=N"
            )

    def _allocate(self, rows: int) -> None:
        shape = (self.spec.num_layers, self.spec.num_kv_heads, rows, self.spec.head_dim)
        self.keys, self.values = self._zeros(shape), self._zeros(shape)

    def _check_room(self, rows: int) -> None:
        if self.length + rows > self.keys.shape[2]:
            raise CapacityError(
                f"KV cache full: {self.length} committed + {rows} new > capacity "
                f"{self.keys.shape[2]}; reset the backend with a larger capacity or lower "
                f"max_new_tokens"
            )

    def _length(self) -> np.ndarray:
        return np.array([self.length], dtype=np.int64)

    def _run(self, method: str, inputs: list) -> dict[str, np.ndarray]:
        """One call -> its outputs by name; where the engine keeps the cache, the pending commit goes with it. The
        commit is taken before the call, so it is never sent twice: a call that raises (having moved the rows or
        not) marks the backend failed until its reset."""
        commit = self.take_commit()
        try:
            outputs = self.runner.run(method, [*inputs, commit] if self.spec.engine_cache else inputs)
        except BaseException as error:
            self.call_failed(method, error)
            raise
        return dict(zip(output_names(method, self.spec.engine_cache), outputs))

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise EngineError(
                f"{self.name}: {self._failed}; reset the backend (every generation does) before calling it again"
            )

    def _keep(self, out: dict[str, np.ndarray], nodes: Iterable[int]) -> None:
        """Commit rows `nodes` of the call that gave `out`: the host copies them into its cache, or (the engine's
        cache) the next call moves them into place."""
        index = np.asarray(list(nodes), dtype=np.int64)
        if self.spec.engine_cache:
            if len(index) and (index[0] < 0 or (np.diff(index) <= 0).any()):
                raise RuntimeError(f"commit of nodes {index.tolist()}: a committed path is ascending")
            if len(index) and not (len(index) == index[-1] + 1):  # rows already in place need no move
                self._commit = self._no_commit.copy()
                self._commit[: len(index)] = index
        else:
            count = len(index)
            self.keys[:, :, self.length : self.length + count] = out["new_keys"][:, :, index]
            self.values[:, :, self.length : self.length + count] = out["new_values"][:, :, index]
        self.length += len(index)

    def _greedy_step(self, method: str, count: int, inputs: list[np.ndarray]) -> StepOutput:
        out = self._run(method, inputs)
        targets, accepted, drafts, states = out["targets"], out["accepted"], out["drafts"], out["stream_states"]
        self._pending = {name: t[:, :, :count] for name, t in out.items() if name in NEW_ROWS}
        graph_node = int(accepted[0])

        def at_accepted(output: np.ndarray):
            def read(node: int) -> np.ndarray:
                if node != graph_node:  # the graph drafted from another node than the host accepted
                    raise RuntimeError(
                        f"greedy_step drafted at node {graph_node} but the host accepted node {node}: "
                        f"the artifact's greedy_step disagrees with runtime/speculation/accept.py; rebuild it"
                    )
                return output

            return read

        return StepOutput(
            None,
            None,
            greedy_tokens=targets[:count].tolist(),
            ranked_drafts=at_accepted(drafts),
            extras={STREAM_STATES: at_accepted(_float(states))},
        )

    @staticmethod
    def _extras(hidden: np.ndarray, stream_states, head_logits) -> dict:
        """StepOutput.extras: the final-normed states, and the stream states and Medusa heads where there are."""
        sources = {HIDDEN: _float(hidden), STREAM_STATES: stream_states, HEAD_LOGITS: head_logits}
        return {key: value for key, value in sources.items() if value is not None}

    def _head_source(self, anchors: np.ndarray, start: int, depths: Sequence[int]):
        """node -> [heads, V] Medusa heads' logits there (None: the graphs have no heads). Once a node is
        committed, its row is start + its depth (a path commits one node per depth), and the heads
        method reruns the top layers there: it sees the rows below, which never change afterwards."""
        if not self.spec.heads:
            return None

        def logits(node: int) -> np.ndarray:
            row = start + depths[node]
            if row >= self.length:
                raise RuntimeError(f"Medusa heads asked at node {node} (row {row}) before its commit")
            if (self._commit >= 0).any() and row + 1 != self.length:  # the moves land below self.length
                raise RuntimeError(
                    f"Medusa heads asked at node {node} (row {row}) below the last committed row "
                    f"{self.length - 1} while the engine's commit is pending: ask at the last one"
                )
            out = self._run(
                "heads", [anchors[node : node + 1], np.array([row + 1], dtype=np.int64), self.keys, self.values]
            )
            return self.spec.full_logits(out["head_logits"])

        return logits

    def _stream_sources(self, anchor_of):
        """StepOutput's stream_logits and stream_states sources: one `streams` call for the accepted node
        gives both, whichever the drafter reads first (anchor_of: node -> its anchor)."""
        run = functools.lru_cache(maxsize=1)(lambda node: self._streams(anchor_of(node)))
        return (lambda node: run(node)[0]), (lambda node: run(node)[1])

    def _streams(self, anchor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Call after the commit: the anchor node's K/V must be in the cache (it is the last row).
        -> ([gamma, V] stream logits, [gamma, H] their final-normed states)."""
        out = self._run("streams", [anchor, self._length(), self.keys, self.values])
        return self.spec.full_logits(out["stream_logits"]), _float(out["stream_states"])


def keep_nodes(tree: TreeSpec, transition: Sequence[float], prune: PruneConfig) -> list[bool]:
    """Nodes that survive pruning; always ancestor-closed, the root always kept."""
    score = [1.0] * tree.num_nodes
    kept = [True] * tree.num_nodes
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        score[node] = score[parent] * transition[node]
        below = prune.threshold is not None and transition[node] < prune.threshold
        kept[node] = kept[parent] and not below
    if prune.budget is not None:
        # Path probability only falls along a path, so the best-scoring nodes form a closed subtree
        # (ties broken towards shallower, earlier nodes, which are ancestors).
        ranked = sorted((n for n in range(1, tree.num_nodes) if kept[n]), key=lambda n: (-score[n], n))
        allowed = set(ranked[: prune.budget])
        kept = [n == 0 or (kept[n] and n in allowed) for n in range(tree.num_nodes)]
        for node in range(1, tree.num_nodes):
            kept[node] = kept[node] and kept[tree.parents[node]]
    return kept


def _ids(tokens: list[int]) -> np.ndarray:
    return np.array([tokens], dtype=np.int64)


def _float(array: np.ndarray) -> np.ndarray:
    """float32 (Core ML's fp16 outputs widened); no copy when it is already."""
    return np.asarray(array, dtype=np.float32)
