"""The graph contract: what an exported model's graphs take and give, read by export (which builds graphs to it,
export/graph.py) and by the runtime (which calls them, runtime/backends/static_graph.py) alike. numpy only.

Every method is a function of explicit tensors; the host allocates the KV cache and hands it to every call:

    prefill(ids [1,P], cache_len [1], keys, values, last [1]) -> logits [1,V], anchor [1,H], hidden [1,H],
                                                                  new_keys, new_values
    decode (ids [1,1], cache_len [1], keys, values)            -> logits [1,V], anchor [1,H], hidden [1,H],
                                                                  new_keys, new_values
    step_T (ids [1,T], cache_len [1], tree [T,T], depths [T], keys, values)
                                                               -> logits [T,V], anchor [T,H], hidden [T,H],
                                                                  new_keys, new_values
    streams(anchor [1,H], cache_len [1], keys, values)         -> stream_logits [gamma,V], stream_states [gamma,H]
    greedy_step_T(ids [1,T], cache_len [1], tree [T,T], depths [T], parents [T], keys, values)
                                                               -> targets [T], accepted [1], drafts [gamma,K],
                                                                  new_keys, new_values, stream_states [gamma,H]
    heads  (anchor [1,H], cache_len [1], keys, values)         -> head_logits [heads,V]   (Medusa heads only)
    batch_step_BxT(ids [1,B*T], cache_len [B], tree [B,T,T], depths [B,T], keys_0, values_0, .., keys_{B-1},
                   values_{B-1}, commit [B,max_nodes])     -> logits [B*T,V], anchor [B*T,H], hidden [B*T,H]
                                                              (engine-cache graphs only: ExecuTorch, ONNX Runtime)

keys / values are the cache [L, kv_heads, C, d] (CACHE_INPUTS), new_keys / new_values a call's rows
[L, kv_heads, T, d] (NEW_ROWS). Who writes the cache (GraphSpec.engine_cache; the manifest's kv_layout owner):
- the engine (ExecuTorch, ONNX Runtime: the exact kernel's graphs): every method takes COMMIT_INPUT last and
  returns no NEW_ROWS; a call moves the rows the host accepted from the previous call into place and writes its own;
- the host (Core ML, the torch session): a call returns its rows and the host copies the accepted ones in.

A tree is data: step and greedy_step take it as inputs (tree_inputs), one graph per row count (a size bucket),
named bucket_method(method, rows); a smaller tree runs in the smallest bucket that holds it, its pad rows seeing
only themselves at depth PAD_DEPTH.

A batched step (batch_method(B, T)) runs B sequences' trees of T rows in one call: row b*T + t of its outputs is
row t of sequence b's own step_T call (decode's for T = 1), bit for bit. Each sequence keeps its own cache
(keys_b, values_b, the same [L, kv, C, d] buffers its single calls take), its own cache_len and its own pending
commit (row b of `commit`, COMMIT_INPUT's meaning on its cache): the linears see all B*T rows at once, attention
runs per sequence. GraphSpec.batches lists the (B, T) pairs an artifact has; the host pads a batch of fewer
sequences with a scratch one (batch_inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from streamfuse.runtime.speculation.tree import TreeSpec

METHODS = ("prefill", "decode", "step", "streams", "greedy_step", "heads")
BUCKET_METHODS = ("step", "greedy_step")
INPUT_NAMES = {
    "prefill": ["ids", "cache_len", "keys", "values", "last"],
    "decode": ["ids", "cache_len", "keys", "values"],
    "step": ["ids", "cache_len", "tree", "depths", "keys", "values"],
    "streams": ["anchor", "cache_len", "keys", "values"],
    "greedy_step": ["ids", "cache_len", "tree", "depths", "parents", "keys", "values"],
    "heads": ["anchor", "cache_len", "keys", "values"],
    "pruned_step": ["ids", "cache_len", "tree", "depths", "parents", "keys", "values"],  # the torch session's only
}
OUTPUT_NAMES = {
    "prefill": ["logits", "anchor", "hidden", "new_keys", "new_values"],
    "decode": ["logits", "anchor", "hidden", "new_keys", "new_values"],
    "step": ["logits", "anchor", "hidden", "new_keys", "new_values"],
    "streams": ["stream_logits", "stream_states"],
    "greedy_step": ["targets", "accepted", "drafts", "new_keys", "new_values", "stream_states"],
    "heads": ["head_logits"],
    "pruned_step": ["logits", "anchor", "hidden", "new_keys", "new_values", "transitions"],
}
# Who writes the cache, as an artifact's manifest records it per backend (kv_layout.owner; GraphSpec.engine_cache):
# the engine (the graphs write it in place and take COMMIT_INPUT) or the host (the graphs return NEW_ROWS).
ENGINE_CACHE, HOST_CACHE = "engine", "host"
CACHE_OWNERS = (ENGINE_CACHE, HOST_CACHE)
CACHE_INPUTS = ("keys", "values")  # the host's cache tensors [L, kv_heads, C, d], every method's inputs
NEW_ROWS = ("new_keys", "new_values")
# The nodes of the previous call's rows the host accepted, ascending, then -1 ([max_nodes] int64; all -1: nothing
# to move). With n of them, the call first moves slot (cache_len - n) + nodes[j] to (cache_len - n) + j, then
# attends and writes its own rows at cache_len.. (runtime/ops/tree_attention.py commit_rows, tree_attention's store).
COMMIT_INPUT = "commit"
# A pad row's depth: its position is the row before the tree's root (a real, finite one), and greedy_step
# weighs reachable rows by depth + 1, so a pad row (weight 0) never wins over the root (weight 1).
PAD_DEPTH = -1
# Where greedy_step runs its streams: "fused", beside every tree node in the verify pass (the paper; memory-bound
# devices); "deferred", after the commit for the last accepted node only (same outputs; compute-bound CPUs).
STREAM_SCHEDULES = ("fused", "deferred")

# ONNX has one entry point per model, so one ONNX model holds every method (export/onnx_methods.py): the int64
# scalar input METHOD_INPUT picks one by its index in method_names(buckets), the model's inputs are the union of
# the methods' (each call feeds all; those its method does not read may be any placeholder), and the method's
# outputs are named method_output(method, name).
METHOD_INPUT = "method"
METHODS_METADATA = "streamfuse.methods"  # the ONNX model's metadata key: its methods in METHOD_INPUT's order
# The ONNX model's metadata key for the tables its gathers read as inputs (the embedding, export/onnx_passes.py):
# {input: {"location": file beside the model, "offset", "shape", "dtype"}}; the host maps them read-only.
EMBEDDING_METADATA = "streamfuse.gathered"
# A task's tensors (LoRA, streams, pruning head) as trailing inputs of every method, in name order, where the
# graphs hold only the base (export/task_inputs.py): the session binds a task's once and adds them to each call.
TASK_PREFIX = "task."


# Batched steps (the module docstring): batch_step_{B}x{T}, inputs BATCH_INPUTS, each sequence's cache
# (batch_cache_names), then COMMIT_INPUT; outputs BATCH_OUTPUTS. T is 1 (decode rows) or a bucket.
BATCH_METHOD = "batch_step"
BATCH_INPUTS = ("ids", "cache_len", "tree", "depths")
BATCH_OUTPUTS = ("logits", "anchor", "hidden")


def base_method(name: str) -> str:
    """The method an exported name runs (greedy_step_8 -> greedy_step, batch_step_4x4 -> batch_step), which gives
    its tensors' names."""
    head, _, rows = name.rpartition("_")
    if head == BATCH_METHOD and batch_shape(name) is not None:
        return BATCH_METHOD
    return head if rows.isdigit() and head in BUCKET_METHODS else name


def batch_method(sequences: int, rows: int) -> str:
    """The name of the batched step of `sequences` sequences of `rows` rows each: batch_step_4x4, ..."""
    return f"{BATCH_METHOD}_{sequences}x{rows}"


def batch_shape(name: str) -> tuple[int, int] | None:
    """(sequences, rows) of a batched step's name (batch_step_4x4 -> (4, 4)); None for any other name."""
    head, _, shape = name.rpartition("_")
    count, x, rows = shape.partition("x")
    if head != BATCH_METHOD or not x or not count.isdigit() or not rows.isdigit():
        return None
    return int(count), int(rows)


def batch_cache_names(sequences: int) -> list[str]:
    """Each sequence's cache inputs of a batched step: keys_0, values_0, keys_1, values_1, ..."""
    return [f"{name}_{index}" for index in range(sequences) for name in CACHE_INPUTS]


def cache_of(name: str) -> str | None:
    """The cache tensor an input is (keys, values; a batched step's keys_b, values_b: keys, values), else None."""
    head, _, index = name.rpartition("_")
    if name in CACHE_INPUTS:
        return name
    return head if head in CACHE_INPUTS and index.isdigit() else None


def parse_batches(text: str) -> tuple[tuple[int, int], ...]:
    """ "2x1,4x4" -> ((2, 1), (4, 4)), sorted; "" -> () (the export's batches setting)."""
    pairs = set()
    for part in (p.strip() for p in text.replace(";", ",").split(",")):
        if not part:
            continue
        shape = batch_shape(f"{BATCH_METHOD}_{part}")
        if shape is None or shape[0] < 1 or shape[1] < 1:
            raise ValueError(f"export.batches: {part!r} is not SEQUENCESxROWS (e.g. 4x4); write e.g. 2x1,4x1,4x4")
        pairs.add(shape)
    return tuple(sorted(pairs, key=lambda pair: (pair[1], pair[0])))


def input_names(method: str, engine_cache: bool) -> list[str]:
    """The inputs of `method` (step_8: step's; batch_step_4x4: its four sequences' caches) in order."""
    shape = batch_shape(method)
    if shape is not None:
        return [*BATCH_INPUTS, *batch_cache_names(shape[0]), COMMIT_INPUT]
    return INPUT_NAMES[base_method(method)] + ([COMMIT_INPUT] if engine_cache else [])


def output_names(method: str, engine_cache: bool) -> list[str]:
    """The outputs of `method` (step_8: step's) in order."""
    if batch_shape(method) is not None:
        return list(BATCH_OUTPUTS)
    return [name for name in OUTPUT_NAMES[base_method(method)] if not (engine_cache and name in NEW_ROWS)]


def bucket_method(method: str, rows: int) -> str:
    """The name of the step or greedy_step graph of `rows` rows: step_8, greedy_step_4, ..."""
    if method not in BUCKET_METHODS:
        raise ValueError(f"{method!r} has no size buckets; bucketed methods: {', '.join(BUCKET_METHODS)}")
    return f"{method}_{rows}"


def method_names(buckets: Sequence[int], heads: bool = False, batches: Sequence[tuple[int, int]] = ()) -> list[str]:
    """Every method of an artifact with step graphs of `buckets` rows (and Medusa heads, and the batched steps
    of `batches`, engine-cache graphs only), in the order exporters list them."""
    bucketed = [bucket_method(m, rows) for rows in buckets for m in BUCKET_METHODS]
    batched = [batch_method(sequences, rows) for sequences, rows in batches]
    return ["prefill", "decode", "streams", *bucketed, *(["heads"] if heads else []), *batched]


def method_output(method: str, name: str) -> str:
    return f"{method}.{name}"


def tree_inputs(tree: TreeSpec, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`tree` as a bucket of `rows` rows takes it: (tree [rows, rows] float 0/1, each node's ancestors and itself;
    depths [rows]; parents [rows], the root its own parent); pad rows see only themselves, at PAD_DEPTH."""
    count = tree.num_nodes
    if count > rows:
        raise ValueError(f"a tree of {count} nodes does not fit a bucket of {rows} rows")
    visible = np.eye(rows, dtype=np.float32)
    visible[:count, :count] = tree.ancestor_mask
    depths = np.array(tree.depths + [PAD_DEPTH] * (rows - count), dtype=np.int64)
    parents = np.array([0, *tree.parents[1:]] + [0] * (rows - count), dtype=np.int64)
    return visible, depths, parents


def batch_inputs(trees: Sequence[TreeSpec], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A batched step's tree [B, rows, rows] and depths [B, rows]: each sequence's tree_inputs, stacked (a scratch
    sequence that pads a batch: any tree, e.g. the root alone TreeSpec(()), its outputs ignored)."""
    pairs = [tree_inputs(tree, rows)[:2] for tree in trees]
    return np.stack([tree for tree, _ in pairs]), np.stack([depths for _, depths in pairs])


@dataclass(frozen=True)
class GraphSpec:
    """What the host must know about the graphs (an artifact's manifest, or the torch session's model)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_streams: int
    capacity: int  # KV rows the graphs attend over (dynamic: the most the host allocates unasked)
    prefill_chunk: int  # prompt tokens per prefill call (dynamic: the whole prompt in one call)
    buckets: tuple[int, ...]  # row counts with step / greedy_step graphs, ascending (dynamic: none)
    greedy_schedules: tuple[str, ...]  # each bucket's greedy_step streams schedule (dynamic: one for all)
    width: int  # ranks per stream greedy_step drafts: a wider tree runs step + streams instead
    heads: int = 0  # Medusa heads the "heads" method ranks (0: no such method)
    # The session runs any row count (torch eager): a tree takes its own rows, no pad; the cache grows on reset.
    dynamic: bool = False
    # Ascending token ids of the logits' columns where the LM head keeps only those rows (a draft model's pruned
    # vocabulary, SpeculativeStreamingLM.keep_vocab); the host gives every other token -inf. None: all V.
    head_ids: np.ndarray | None = field(default=None, compare=False)
    # The graphs write the cache themselves and take each commit as input (COMMIT_INPUT); else the host does.
    engine_cache: bool = False
    # (sequences, rows) of the batched steps (batch_method), ordered by rows then sequences; engine cache only.
    batches: tuple[tuple[int, int], ...] = ()

    def full_logits(self, logits: np.ndarray) -> np.ndarray:
        """[..., V] float32 logits from a graph's [..., V] or, with head_ids, [..., D]."""
        if self.head_ids is None:
            return np.asarray(logits, dtype=np.float32)
        full = np.full((*logits.shape[:-1], self.vocab_size), -np.inf, dtype=np.float32)
        full[..., self.head_ids] = logits
        return full

    @property
    def max_nodes(self) -> int | None:
        """The largest tree a step takes (None: any)."""
        return None if self.dynamic else self.buckets[-1]

    def bucket(self, tree: TreeSpec) -> int:
        """The rows of the smallest step graph that holds `tree`."""
        if self.dynamic:
            return tree.num_nodes
        for rows in self.buckets:
            if tree.num_nodes <= rows:
                return rows
        raise ValueError(
            f"a tree of {tree.num_nodes} nodes is larger than the artifact's largest step graph "
            f"({self.max_nodes} rows): use a tree of at most {self.max_nodes} nodes, or rebuild the "
            f"artifact with streamfuse build --set export.buckets=...,{tree.num_nodes}"
        )

    def drafts_from(self, tree: TreeSpec) -> bool:
        """Whether greedy_step's ranked drafts cover every level of `tree`."""
        return max(tree.widths) <= self.width

    def batch(self, sequences: int, rows: int) -> tuple[int, int] | None:
        """The smallest batched step that holds `sequences` sequences of `rows` rows (the host pads the rest with
        scratch sequences); None where the graphs have none."""
        fits = [pair for pair in self.batches if pair[1] == rows and pair[0] >= sequences]
        return min(fits) if fits else None

    def schedule(self, rows: int) -> str:
        return self.greedy_schedules[0 if self.dynamic else self.buckets.index(rows)]
