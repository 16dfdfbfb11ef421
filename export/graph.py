"""Static-shape graphs of a Speculative Streaming model: what ExecuTorch, ONNX and Core ML compile.

Every method is a function of explicit tensors, its inputs, outputs and shapes the contract's
(runtime/artifact/contract.py: INPUT_NAMES, OUTPUT_NAMES, and the table there); the host allocates the KV cache and
hands it to every call.

The draft tree is data: step_T and greedy_step_T exist for each size bucket T (GraphShapes.buckets)
and take the tree as inputs: `tree` row i is 1 at node i's ancestors and itself, `depths` gives each
node's position past cache_len, `parents` each node's parent (the root its own). Any tree of up to T
nodes runs in the bucket; the host pads the rest with rows that see only themselves at depth -1
(runtime/artifact/contract.py tree_inputs), which no real row sees and greedy_step never accepts.
Calibration may pick any tree up to the largest bucket with no re-export, and a method may change its
tree every step.

keys/values [L, kv_heads, C, d] hold the committed cache: rows < cache_len are attended to,
the rest are masked out. new_keys/new_values [L, kv_heads, T, d] are this call's rows; the host copies the accepted
ones into its cache. On ExecuTorch and ONNX Runtime (GraphShapes.span) the engine keeps the cache instead: the
attention kernel reads only rows < cache_len, in place, and writes the call's rows into slots cache_len.. of the
given buffers; every method takes one more input, commit [max_nodes] (the nodes of the previous call the host
accepted, ascending, then -1), and first moves those rows into place; no method returns new_keys/new_values
(runtime/artifact/contract.py COMMIT_INPUT). prefill is a causal chunk of P tokens (a constant chain), decode a
chain of 1.
anchor is each row's main-stream state at layer N - N_s: the streams method runs
the gamma streams of the last accepted node after its commit (the deferred schedule, whose
outputs equal the fused pass's; on CPUs it is the cheaper one). hidden is each row's final-normed
state, the logits' input: a draft model's SpecDec++ acceptance head reads it (method specdec++).

heads (an artifact with Medusa heads, method medusa) reruns the top N_s layers for the node committed
at row cache_len - 1 (its anchor), seeing the rows below it, and ranks its final state through the
heads and the shared LM head: the step graphs stay as they are, at one extra call like the streams'.

greedy_step is step + streams in one call for greedy decoding: the graph takes each node's
argmax (targets), finds the accepted node by the greedy rule, and returns the top-K token ids
(K: GraphShapes.width, the widest level the artifact's trees may have, so the next step may take any
of them; a wider tree runs step + streams) of that node's streams, run beside every node (fused) or for that
node alone after verifying (deferred); see GreedyStepPass. One call per step, and no [T, V] logits leave the
graph. The host still decides acceptance from `targets`; `accepted` only says whose streams the drafts are.
streams and greedy_step also return the streams' final-normed states [gamma, H] (stream_states): method
ss-adaptive's acceptance head reads them on the host.

batch_step_{B}x{T} (GraphShapes.batches, the span graphs only) runs B sequences' step_T (decode's for T = 1) in one
call, each on its own cache (export/batch_pass.py).

The methods' modules are export/passes.py's (the torch backend runs the same ones eagerly); this module fixes
their static shapes and layout for export.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.batch_pass import BatchStepPass, batch_example
from streamfuse.export.passes import (
    APPEND,
    SPAN,
    GreedyStepPass,
    HeadsPass,
    MainPass,
    PrefillPass,
    StepPass,
    StreamsPass,
)
from streamfuse.runtime.artifact.contract import (
    STREAM_SCHEDULES,
    GraphSpec,
    batch_method,
    bucket_method,
    input_names,
    output_names,
    tree_inputs,
)
from streamfuse.runtime.speculation.tree import TreeSpec


@dataclass(frozen=True)
class GraphShapes:
    """The static sizes every exported method is traced with."""

    capacity: int  # C: KV rows the graphs attend over (prompt + generated + one step)
    prefill_chunk: int  # P: prompt tokens per prefill call
    buckets: tuple[int, ...]  # row counts T with step graphs, ascending: any tree of up to T nodes runs in T
    # Attention reads the cache in place over [0, cache_len) through the exact kernel (export/span_attention.py;
    # the model's attention must be span_attention): rows see the cache, then the call's rows, in key order,
    # so a row's bits do not depend on the call; its cost grows with the used span (ExecuTorch, ONNX Runtime).
    # Else the call's rows are appended after the C cache rows and attention is the model's own (Core ML).
    span: bool = False
    # Ranks per stream greedy_step drafts, at least max_nodes - 1 (the widest level such a tree has): ranks
    # are not node counts, and calibration's trees reach rank MAX_RANK - 1 with a lookup branch one rank
    # further (training/calibration.py MAX_RANK = 8).
    draft_width: int = 9
    # (sequences, rows) of the batched steps (runtime/artifact/contract.py batch_method; export/batch_pass.py): the span
    # graphs only (they keep each sequence's cache in the engine); rows 1 (decode rows) or a bucket.
    batches: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 2:
            raise ValueError(
                f"step graph buckets must be distinct row counts >= 2 (a root and one draft), "
                f"ascending; got {list(self.buckets)}"
            )
        if self.prefill_chunk < 1 or self.capacity < self.prefill_chunk + self.max_nodes:
            raise ValueError(
                f"capacity {self.capacity} must hold at least one prefill chunk ({self.prefill_chunk}) "
                f"plus the largest step ({self.max_nodes} rows)"
            )
        for sequences, rows in self.batches:
            if sequences < 2 or rows not in (1, *self.buckets):
                raise ValueError(
                    f"export.batches has {sequences}x{rows}: a batched step takes 2 or more sequences of 1 row "
                    f"or of a bucket's rows ({', '.join(map(str, self.buckets))}); fix export.batches"
                )

    @property
    def max_nodes(self) -> int:
        return self.buckets[-1]

    @property
    def width(self) -> int:
        """Ranks per stream greedy_step drafts (K): draft_width, or more for a wider largest bucket."""
        return max(self.draft_width, self.max_nodes - 1)

    @property
    def layout(self) -> str:
        """Where a call's new rows sit for attention (export/passes.py)."""
        return SPAN if self.span else APPEND


# Largest bucket whose greedy_step runs streams beside every row under "auto". On the 2-core CPU
# (ONNX Runtime, SmolLM2-135M, N_s 8, gamma 3; tools/graph_latency.py) fused/deferred take
# 47.7/52.3 ms for the 4-node chain and 81.6/69.2 ms for 15 nodes (a 6-node tree is about even):
# extra rows cost compute, re-reading the MSA layers' weights costs bandwidth.
FUSED_MAX_NODES = 7
GREEDY_SCHEDULES = ("auto", *STREAM_SCHEDULES)


def greedy_schedule(rows: int, choice: str) -> str:
    """ "fused" or "deferred" for the greedy_step of `rows` rows; "auto" picks by size (FUSED_MAX_NODES)."""
    if choice not in GREEDY_SCHEDULES:
        raise ValueError(f"greedy_step schedule must be one of {', '.join(GREEDY_SCHEDULES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "fused" if rows <= FUSED_MAX_NODES else "deferred"


def graph_modules(
    model: SpeculativeStreamingLM,
    shapes: GraphShapes,
    draft_ids: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    heads: nn.Module | None = None,
) -> dict[str, nn.Module]:
    """method name -> module, in contract.method_names order; the same model weights are shared by
    all of them. draft_ids and schedules (one per bucket; default deferred) shape greedy_step only;
    heads (Medusa's) add the heads method."""
    layout = shapes.layout
    schedules = schedules or ["deferred"] * len(shapes.buckets)
    modules = {
        "prefill": PrefillPass(model, shapes.prefill_chunk, layout),
        "decode": MainPass(model, 1, layout),
        "streams": StreamsPass(model, layout),
    }
    for rows, schedule in zip(shapes.buckets, schedules, strict=True):
        modules[bucket_method("step", rows)] = StepPass(model, layout)
        modules[bucket_method("greedy_step", rows)] = GreedyStepPass(
            model, rows, shapes.width, draft_ids, schedule, layout
        )
    if heads is not None:
        modules["heads"] = HeadsPass(model, heads, layout)
    for sequences, rows in shapes.batches if shapes.span else ():
        modules[batch_method(sequences, rows)] = BatchStepPass(model, sequences, rows)
    return modules


def graph_spec(
    model: SpeculativeStreamingLM, shapes: GraphShapes, schedules: Sequence[str], heads: int = 0
) -> GraphSpec:
    """What the host must know to run graph_modules(model, shapes, ..., schedules) (and `heads` Medusa heads)."""
    parts = model.parts
    return GraphSpec(
        parts.num_layers,
        parts.num_kv_heads,
        parts.head_dim,
        parts.vocab_size,
        model.num_streams,
        shapes.capacity,
        shapes.prefill_chunk,
        shapes.buckets,
        tuple(schedules),
        shapes.width,
        heads,
        head_ids=model.kept_vocab(),
        engine_cache=shapes.span,
        batches=shapes.batches if shapes.span else (),
    )


def example_inputs(model: SpeculativeStreamingLM, shapes: GraphShapes) -> dict[str, tuple[torch.Tensor, ...]]:
    """Inputs with the exported shapes and dtypes (values are arbitrary but valid: a bucket holds a chain
    one row short of it, so it has a pad row)."""
    parts = model.parts
    shape = (parts.num_layers, parts.num_kv_heads, shapes.capacity, parts.head_dim)
    # Distinct tensors for keys and values: torch.export would fold one aliased input into both.
    keys, values = torch.zeros(shape), torch.zeros(shape)
    length = torch.tensor([shapes.prefill_chunk], dtype=torch.long)

    def ids(count: int) -> torch.Tensor:
        return torch.zeros(1, count, dtype=torch.long)

    inputs = {
        "prefill": (ids(shapes.prefill_chunk), length, keys, values, torch.tensor([shapes.prefill_chunk - 1])),
        "decode": (ids(1), length, keys, values),
        "streams": (torch.zeros(1, parts.hidden_size), length, keys, values),
        "heads": (torch.zeros(1, parts.hidden_size), length, keys, values),
    }
    for rows in shapes.buckets:
        tree, depths, parents = map(torch.from_numpy, tree_inputs(TreeSpec.chain(max(rows - 2, 1)), rows))
        inputs[bucket_method("step", rows)] = (ids(rows), length, tree, depths, keys, values)
        inputs[bucket_method("greedy_step", rows)] = (ids(rows), length, tree, depths, parents, keys, values)
    if shapes.span:  # a commit moving nothing: the example's values must be valid, the moves' cost is not traced
        commit = torch.full((shapes.max_nodes,), -1, dtype=torch.long)
        inputs = {name: (*tensors, commit) for name, tensors in inputs.items()}
        for sequences, rows in shapes.batches:
            inputs[batch_method(sequences, rows)] = batch_example(
                model, sequences, rows, keys, values, shapes.max_nodes
            )
    return inputs


def names_of(methods, shapes: GraphShapes) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Input and output tensor names of each exported method (a bucket's: those of step / greedy_step)."""
    return ({m: input_names(m, shapes.span) for m in methods}, {m: output_names(m, shapes.span) for m in methods})


def signature(modules: dict[str, nn.Module], inputs: dict[str, tuple[torch.Tensor, ...]], shapes: GraphShapes) -> dict:
    """Per method: input and output names, shapes and dtypes (for the manifest and for checks). The span graphs
    write their example cache: it runs on copies."""
    result = {}
    with torch.no_grad():
        for name, module in modules.items():
            outputs = module(*(t.clone() for t in inputs[name]))
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            result[name] = {
                "inputs": [_describe(n, t) for n, t in zip(input_names(name, shapes.span), inputs[name])],
                "outputs": [_describe(n, t) for n, t in zip(output_names(name, shapes.span), outputs)],
            }
    return result


def _describe(name: str, tensor: torch.Tensor) -> dict:
    return {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
