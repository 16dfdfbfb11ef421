"""The backend for exported static-shape graphs (ExecuTorch, ONNX Runtime, Core ML).

The graphs are pure functions (see the artifact's manifest, "methods"); this class owns what
they leave to the host: the KV cache [L, kv_heads, C, d], chunked prefill, committing the
accepted tree nodes' rows, and running the streams of the last accepted node after the commit.
A `Session` is the only engine-specific part: it runs one named method on a list of tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from streamfuse.runtime.backends.base import PruneConfig, StepOutput, process_peak_rss_bytes
from streamfuse.runtime.kv_cache import CapacityError
from streamfuse.runtime.tree import TreeSpec


# The exported methods and their tensors (export/graph.py builds graphs to this). An artifact holds
# several draft trees: each has its own step and greedy_step, named tree_method(method, index); one
# with Medusa heads (method medusa) also has "heads".
METHODS = ("prefill", "decode", "step", "streams", "greedy_step", "heads")
TREE_METHODS = ("step", "greedy_step")
INPUT_NAMES = {
    "prefill": ["ids", "cache_len", "keys", "values", "last"],
    "decode": ["ids", "cache_len", "keys", "values"],
    "step": ["ids", "cache_len", "keys", "values"],
    "streams": ["anchor", "cache_len", "keys", "values"],
    "greedy_step": ["ids", "cache_len", "keys", "values"],
    "heads": ["anchor", "cache_len", "keys", "values"],
}
OUTPUT_NAMES = {
    "prefill": ["logits", "anchor", "hidden", "new_keys", "new_values"],
    "decode": ["logits", "anchor", "hidden", "new_keys", "new_values"],
    "step": ["logits", "anchor", "hidden", "new_keys", "new_values"],
    "streams": ["stream_logits", "stream_states"],
    "greedy_step": ["targets", "accepted", "drafts", "new_keys", "new_values", "stream_states"],
    "heads": ["head_logits"],
}



def tree_method(method: str, index: int) -> str:
    """The name of tree `index`'s step or greedy_step: step_0, greedy_step_1, ..."""
    if method not in TREE_METHODS:
        raise ValueError(f"{method!r} does not depend on the tree; tree methods: {', '.join(TREE_METHODS)}")
    return f"{method}_{index}"


def base_method(name: str) -> str:
    """The method an exported name runs (greedy_step_1 -> greedy_step), which gives its tensors' names."""
    head, _, index = name.rpartition("_")
    return head if index.isdigit() and head in TREE_METHODS else name


def method_names(trees: int, heads: bool = False) -> list[str]:
    """Every method of an artifact with `trees` draft trees (and Medusa heads), in the order exporters list them."""
    tree_methods = [tree_method(m, i) for i in range(trees) for m in TREE_METHODS]
    return ["prefill", "decode", "streams", *tree_methods, *(["heads"] if heads else [])]


# The host's cache tensors [L, kv_heads, C, d]. ONNX graphs take them as L inputs each, <name>_<layer>
# [1, kv_heads, C, d] (zero-copy views of the host's tensors): one [L, ...] input would be split
# into per-layer copies inside every call, 35 MB for SmolLM2 at C = 768 (docs/export.md).
CACHE_INPUTS = ("keys", "values")


def layer_input(name: str, layer: int) -> str:
    return f"{name}_{layer}"


# ONNX has one entry point per model, so one ONNX model holds every method (export/onnx_methods.py):
# the int64 scalar input METHOD_INPUT picks one by its index in method_names(trees), the model's inputs are the
# union of the methods' (each call feeds all; those its method does not read may be any placeholder),
# and the method's outputs are named method_output(method, name).
METHOD_INPUT = "method"
METHODS_METADATA = "streamfuse.methods"  # the ONNX model's metadata key: its methods in METHOD_INPUT's order


def method_output(method: str, name: str) -> str:
    return f"{method}.{name}"


# Methods whose ONNX graphs take the cache rows up to their own (cache_len + P, any length up to C)
# rather than all C: a prefill chunk attends over what precedes it, not over the empty rest of the
# cache (a 250-token prompt: 64..256 rows instead of 768 per chunk). Prefill is shared by plain and
# speculative decoding, so its attention span does not touch SS == plain; decode and step keep C.
DYNAMIC_SPAN = ("prefill",)


class Session(Protocol):
    name: str  # engine and where it runs, e.g. "onnxruntime:CPUExecutionProvider"

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run one exported method; outputs in the manifest's order."""


@dataclass(frozen=True)
class GraphSpec:
    """What the host must know about the exported graphs (from the artifact manifest)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_streams: int
    capacity: int  # KV rows the graphs attend over
    prefill_chunk: int
    trees: tuple[TreeSpec, ...]  # the trees with step graphs, tree i's methods are step_i and greedy_step_i
    greedy_schedules: tuple[str, ...]  # each tree's greedy_step streams schedule
    heads: int = 0  # Medusa heads the "heads" method ranks (0: no such method)

    @property
    def tree(self) -> TreeSpec:
        """The artifact's default tree (the first)."""
        return self.trees[0]

    def tree_index(self, tree: TreeSpec) -> int:
        """The graph exported for exactly `tree`."""
        for index, exported in enumerate(self.trees):
            if exported.hash() == tree.hash():
                return index
        raise self._missing(tree)

    def graph_for(self, tree: TreeSpec) -> tuple[int, list[int] | None]:
        """The graph that runs `tree`: its own (-> index, None), else the smallest whose paths include
        all of tree's (-> index, the graph node of each tree node). Inside a larger tree every node
        sees exactly its ancestors, at the same depths, so its outputs are its own graph's; the other
        nodes ride along, padded, and are never read."""
        for index, exported in enumerate(self.trees):
            if exported.hash() == tree.hash():
                return index, None
        wanted = set(tree.paths)
        holders = [(t.num_nodes, i) for i, t in enumerate(self.trees) if wanted <= set(t.paths)]
        if not holders:
            raise self._missing(tree)
        index = min(holders)[1]
        node = {path: n for n, path in enumerate(self.trees[index].paths, start=1)}
        return index, [0] + [node[path] for path in tree.paths]

    def _missing(self, tree: TreeSpec) -> ValueError:
        shapes = "; ".join(str(t.to_dict()["paths"]) for t in self.trees)
        return ValueError(f"the artifact has step graphs for the trees {shapes}, none holding {tree.to_dict()['paths']} (hash "
                         f"{tree.hash()}): omit --tree to use the calibrated one, or rebuild the artifact with "
                         f"export/build.py --set export.trees='TREE;...'")


class StaticGraphBackend:
    """Backend protocol over a Session. Greedy steps run the tree's greedy_step, one call (unless
    use_greedy_step is False); otherwise, and for sampling, its `step` and then, after the commit,
    a `streams` call for the accepted node (the deferred schedule)."""

    def __init__(self, session: Session, spec: GraphSpec, device: str = "cpu", use_greedy_step: bool = True):
        self.session = session
        self.spec = spec
        self.use_greedy_step = use_greedy_step
        self.name = session.name
        self.device = device
        self.num_streams = spec.num_streams
        self.vocab_size = spec.vocab_size
        self.max_positions = spec.capacity  # the artifact's context: a run must fit its static cache
        shape = (spec.num_layers, spec.num_kv_heads, spec.capacity, spec.head_dim)
        self.keys = torch.zeros(shape)
        self.values = torch.zeros(shape)
        self.length = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self, capacity: int) -> None:
        if capacity > self.spec.capacity:
            raise CapacityError(f"a run needs {capacity} KV positions but the artifact was exported with capacity "
                                f"{self.spec.capacity}; lower max_new_tokens or rebuild with a larger --set export.capacity=N")
        self.length = 0
        self._pending = None

    def prefill(self, token_ids: Sequence[int], with_streams: bool) -> StepOutput:
        chunk = self.spec.prefill_chunk
        tokens = list(token_ids)
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            ids = torch.tensor([piece + [0] * (chunk - len(piece))])  # pad rows come last: causal, never seen
            logits, anchor, hidden, new_keys, new_values = self.session.run(
                "prefill", [ids, self._length(), self.keys, self.values, torch.tensor([len(piece) - 1])])
            self._store(new_keys[:, :, : len(piece)], new_values[:, :, : len(piece)])
        stream_logits, stream_states = self._stream_sources(lambda node: anchor) if with_streams else (None, None)
        return StepOutput(logits.float(), stream_logits, stream_states=stream_states,
                          head_logits=self._head_source(anchor, self.length - 1, [0]), hidden=hidden.float())

    def step(self, tokens: Sequence[int], tree: TreeSpec | None, with_streams: bool,
             prune: PruneConfig | None = None, greedy: bool = False) -> StepOutput:
        if prune is not None:
            raise ValueError("exported graphs have a static tree: pruning needs the torch backend (--backend torch)")
        index, nodes = self.spec.graph_for(tree) if tree is not None else (None, None)
        method = tree_method("step", index) if tree is not None else "decode"
        if len(tokens) != (tree.num_nodes if tree is not None else 1):
            raise ValueError(f"{method} takes {tree.num_nodes if tree else 1} tokens, got {len(tokens)}")
        width = len(tokens) if nodes is None else self.spec.trees[index].num_nodes
        if self.length + width > self.spec.capacity:
            raise CapacityError(f"KV cache full: {self.length} committed + {width} new > capacity {self.spec.capacity}")
        inputs = [torch.tensor([self._padded(tokens, nodes, width)]), self._length(), self.keys, self.values]
        if greedy and with_streams and tree is not None and self.use_greedy_step and nodes is None:
            return self._greedy_step(tree_method("greedy_step", index), inputs)
        logits, anchors, hidden, new_keys, new_values = self.session.run(method, inputs)
        if nodes is not None:  # back to the tree's own nodes, in its order
            rows = torch.tensor(nodes)
            logits, anchors, hidden = (t.index_select(0, rows) for t in (logits, anchors, hidden))
            new_keys, new_values = new_keys.index_select(2, rows), new_values.index_select(2, rows)
        self._pending = (new_keys, new_values)
        stream_logits, stream_states = (self._stream_sources(lambda node: anchors[node : node + 1]) if with_streams
                                        else (None, None))
        depths = tree.depths if tree is not None else [0]
        return StepOutput(logits.float(), stream_logits, stream_states=stream_states,
                          head_logits=self._head_source(anchors, self.length, depths), hidden=hidden.float())

    @staticmethod
    def _padded(tokens: Sequence[int], nodes: list[int] | None, width: int) -> list[int]:
        """The graph's input row: the tokens at their graph nodes, 0 at the nodes the tree lacks."""
        if nodes is None:
            return list(tokens)
        row = [0] * width
        for token, node in zip(tokens, nodes):
            row[node] = token
        return row

    def stream_schedule(self, tree: TreeSpec) -> str:
        """Where a greedy step of `tree` runs its streams (greedy_step's schedule), else deferred."""
        index, nodes = self.spec.graph_for(tree)
        return self.spec.greedy_schedules[index] if self.use_greedy_step and nodes is None else "deferred"

    def commit(self, nodes: Sequence[int]) -> None:
        if self._pending is None:
            raise RuntimeError("commit without a step")
        new_keys, new_values = self._pending
        index = torch.tensor(list(nodes), dtype=torch.long)
        self._store(new_keys.index_select(2, index), new_values.index_select(2, index))
        self._pending = None

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length}: the cache holds {self.length} committed rows")
        self.length = length  # the graphs attend to rows below cache_len only
        self._pending = None

    def peak_memory_bytes(self) -> int | None:
        return process_peak_rss_bytes()

    # --- helpers ----------------------------------------------------------------------------
    def _length(self) -> torch.Tensor:
        return torch.tensor([self.length], dtype=torch.long)

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        count = keys.shape[2]
        self.keys[:, :, self.length : self.length + count] = keys
        self.values[:, :, self.length : self.length + count] = values
        self.length += count

    def _greedy_step(self, method: str, inputs: list[torch.Tensor]) -> StepOutput:
        targets, accepted, drafts, new_keys, new_values, states = self.session.run(method, inputs)
        self._pending = (new_keys, new_values)
        graph_node = int(accepted[0])

        def at_accepted(output: torch.Tensor):
            def read(node: int) -> torch.Tensor:
                if node != graph_node:  # the graph drafted from another node than the host accepted
                    raise RuntimeError(f"greedy_step drafted at node {graph_node} but the host accepted node {node}: "
                                       f"the artifact's greedy_step disagrees with runtime/accept.py; rebuild it")
                return output
            return read

        return StepOutput(None, None, greedy_tokens=targets.tolist(), ranked_drafts=at_accepted(drafts),
                          stream_states=at_accepted(states.float()))

    def _head_source(self, anchors: torch.Tensor, start: int, depths: Sequence[int]):
        """node -> [heads, V] Medusa heads' logits there (None: the graphs have no heads). Once a node is
        committed, its row is start + its depth (a path commits one node per depth), and the heads
        method reruns the top layers there: it sees the rows below, which never change afterwards."""
        if not self.spec.heads:
            return None

        def logits(node: int) -> torch.Tensor:
            row = start + depths[node]
            if row >= self.length:
                raise RuntimeError(f"Medusa heads asked at node {node} (row {row}) before its commit")
            (out,) = self.session.run("heads", [anchors[node : node + 1], torch.tensor([row + 1]), self.keys,
                                                self.values])
            return out.float()

        return logits

    def _stream_sources(self, anchor_of):
        """StepOutput's stream_logits and stream_states sources: one `streams` call for the accepted node
        gives both, whichever the drafter reads first (anchor_of: node -> its anchor)."""
        run = functools.lru_cache(maxsize=1)(lambda node: self._streams(anchor_of(node)))
        return (lambda node: run(node)[0]), (lambda node: run(node)[1])

    def _streams(self, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Call after the commit: the anchor node's K/V must be in the cache (it is the last row).
        -> ([gamma, V] stream logits, [gamma, H] their final-normed states)."""
        logits, states = self.session.run("streams", [anchor, self._length(), self.keys, self.values])
        return logits.float(), states.float()
