"""Static-shape graphs of a Speculative Streaming model: what ExecuTorch, ONNX and Core ML compile.

Every method is a pure function of explicit tensors; the host owns the KV cache:

    prefill(ids [1,P], cache_len [1], last [1], keys, values) -> logits [1,V], anchor [1,H], hidden [1,H],
                                                                  new_keys, new_values
    decode (ids [1,1], cache_len [1], keys, values)            -> logits [1,V], anchor [1,H], hidden [1,H],
                                                                  new_keys, new_values
    step_T (ids [1,T], cache_len [1], tree [T,T], depths [T], keys, values)
                                                               -> logits [T,V], anchor [T,H], hidden [T,H],
                                                                  new_keys, new_values
    streams(anchor [1,H], cache_len [1], keys, values)         -> stream_logits [gamma,V], stream_states
    greedy_step_T(ids [1,T], cache_len [1], tree [T,T], depths [T], parents [T], keys, values)
                                                               -> targets [T], accepted [1], drafts [gamma,K],
                                                                  new_keys, new_values, stream_states
    heads  (anchor [1,H], cache_len [1], keys, values)         -> head_logits [heads,V]   (Medusa heads only)

The draft tree is data: step_T and greedy_step_T exist for each size bucket T (GraphShapes.buckets)
and take the tree as inputs: `tree` row i is 1 at node i's ancestors and itself, `depths` gives each
node's position past cache_len, `parents` each node's parent (the root its own). Any tree of up to T
nodes runs in the bucket; the host pads the rest with rows that see only themselves at depth -1
(runtime/backends/static_graph.py tree_inputs), which no real row sees and greedy_step never accepts.
Calibration may pick any tree up to the largest bucket with no re-export, and a method may change its
tree every step.

keys/values [L, kv_heads, C, d] hold the committed cache: rows < cache_len are attended to,
the rest are masked out. A graph reads the cache's row count from its inputs, so an engine may pass
fewer than C rows (ONNX Runtime: the rows up to the call's own, runtime/backends/static_graph.py span_rows).
new_keys/new_values [L, kv_heads, T, d] are this call's rows; the host copies the accepted
ones into its cache. prefill is a causal chunk of P tokens (a constant chain), decode a chain of 1.
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
of them; a wider tree runs step + streams) of that node's streams, run beside every node (fused) or for that node alone after verifying
(deferred); see GreedyStepPass. One call per step, and no [T, V]
logits leave the graph. The host still decides acceptance from `targets`; `accepted` only says
whose streams the drafts are. streams and greedy_step also return the streams' final-normed states
[gamma, H] (stream_states): method ss-adaptive's acceptance head reads them on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.model import LowerState, SpeculativeStreamingLM
from streamfuse.adapters.msa import KeyValues, SpanKeyValues, StepKeyValues, in_place_slots
from streamfuse.runtime.backends.static_graph import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    GraphSpec,
    base_method,
    bucket_method,
    tree_inputs,
)
from streamfuse.runtime.options import STREAM_SCHEDULES
from streamfuse.runtime.tree import TreeSpec

# The K or V cache as a graph input: one [L, kv, C, d] tensor, or L tensors [1, kv, C, d].
Cache = torch.Tensor | list[torch.Tensor]


@dataclass(frozen=True)
class GraphShapes:
    """The static sizes every exported method is traced with."""

    capacity: int  # C: KV rows the graphs attend over (prompt + generated + one step)
    prefill_chunk: int  # P: prompt tokens per prefill call
    buckets: tuple[int, ...]  # row counts T with step graphs, ascending: any tree of up to T nodes runs in T
    # Where a call's new rows sit for attention: False, after the C cache rows; True, at slots
    # cache_len.. of the cache (MainPass): a chain node then sees exactly what plain decoding of its
    # token sees, slot for slot, so reductions add the same terms in the same order (ONNX Runtime's
    # sums depend on where the terms sit, and int8 activations would turn 1-ulp differences into flips).
    in_place: bool = False
    # Attention reads the cache in place over [0, cache_len) through the exact kernel (export/span_attention.py;
    # the model's attention must be span_attention): rows see the cache, then the call's rows, in key order,
    # so a row's bits do not depend on the call; its cost grows with the used span (ExecuTorch).
    span: bool = False
    # Ranks per stream greedy_step drafts, at least max_nodes - 1 (the widest level such a tree has): ranks
    # are not node counts, and calibration's trees reach rank MAX_RANK - 1 with a lookup branch one rank
    # further (training/calibration.py MAX_RANK = 8).
    draft_width: int = 9

    def __post_init__(self):
        if self.in_place and self.span:
            raise ValueError("in_place and span are two layouts of the new rows: choose one")
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 2:
            raise ValueError(f"step graph buckets must be distinct row counts >= 2 (a root and one draft), "
                             f"ascending; got {list(self.buckets)}")
        if self.prefill_chunk < 1 or self.capacity < self.prefill_chunk + self.max_nodes:
            raise ValueError(f"capacity {self.capacity} must hold at least one prefill chunk ({self.prefill_chunk}) "
                             f"plus the largest step ({self.max_nodes} rows)")

    @property
    def max_nodes(self) -> int:
        return self.buckets[-1]

    @property
    def width(self) -> int:
        """Ranks per stream greedy_step drafts (K): draft_width, or more for a wider largest bucket."""
        return max(self.draft_width, self.max_nodes - 1)


def decode_order(cache_len: torch.Tensor, visible: torch.Tensor, depths: torch.Tensor, span: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's keys sit in plain decoding, for the in-place layout (`span` slots: the cache rows the
    call takes, the call's row j at slot cache_len + j). Plain decoding of row t's path puts its ancestor at depth k in slot cache_len
    + k, not cache_len + its index: the same keys in other places, which ONNX Runtime's Softmax and
    MatMul sum in another order (a sibling's row differed from plain decoding by 1e-8, then flipped
    4-bit activations' rounding; tests/test_export.py). Returns [T, span] int64:
    source[t, p]: the slot whose score plain decoding has at place p (-1: none, a masked score);
    place[t, s]: the place of slot s's probability in plain decoding (-1: none, a zero)."""
    rows, slots = visible.shape[0], torch.arange(span, device=visible.device)
    depths = depths.clamp(min=0)  # a pad row (depth -1, seeing only itself) is ordered as a root
    offset = slots - cache_len  # [span]: a new row's index for the slots at or past cache_len
    nodes = torch.arange(rows, device=visible.device)
    at_depth = (depths[None, :] == nodes[:, None]).to(visible.dtype)  # [k, j]: node j sits at depth k
    ancestor = (visible[:, None, :] * at_depth[None] * nodes.to(visible.dtype)).sum(-1).to(torch.long)  # [t, k]
    step = offset.clamp(0, rows - 1)  # as a place: a depth; as a slot: a node
    own = torch.logical_and(offset[None, :] >= 0, offset[None, :] <= depths[:, None])  # places of the row's path
    source = torch.where(own, cache_len + ancestor.index_select(1, step), -1)
    sees = torch.logical_and(torch.logical_and(offset >= 0, offset < rows)[None, :], visible.index_select(1, step) > 0)
    place = torch.where(sees, cache_len + depths.index_select(0, step)[None, :], -1)
    cached = (offset < 0)[None, :]
    return torch.where(cached, slots[None, :], source), torch.where(cached, slots[None, :], place)


def cache_mask(cache_len: torch.Tensor, capacity: int, rows: int) -> torch.Tensor:
    """[rows, C] additive: cache row c is visible iff c < cache_len."""
    hidden = torch.arange(capacity, device=cache_len.device)[None, :] >= cache_len[:, None]
    # A product, not torch.where with a scalar: Core ML's converter has no where.ScalarOther.
    return (hidden.to(torch.float32) * GRAPH_MASKED).expand(rows, capacity)


def split_cache(keys: Cache, values: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache per layer ([1, kv, C, d] keys and values) as the model's K/V provider reads it, from
    [L, kv, C, d] tensors or from per-layer lists (the ONNX graphs' inputs: export/to_onnx.py)."""
    if isinstance(keys, (list, tuple)):
        return list(zip(keys, values))
    # Slices, not index + unsqueeze: XNNPACK takes slices, so they do not split its partitions.
    return [(keys[layer : layer + 1], values[layer : layer + 1]) for layer in range(keys.shape[0])]


def keys_rows(keys: Cache) -> int:
    """The cache rows a call was given (C, or fewer on ONNX Runtime), from [L, kv, C, d] or per-layer keys."""
    return (keys[0] if isinstance(keys, (list, tuple)) else keys).shape[2]


def tree_mask(visible: torch.Tensor) -> torch.Tensor:
    """Additive [T, T] from 0/1 visibility. A product, not torch.where with a scalar (Core ML's converter
    has no where.ScalarOther); a visible entry becomes -0.0, which adds to a score like 0.0."""
    return (1.0 - visible) * GRAPH_MASKED


def main_lower(model: SpeculativeStreamingLM, ids, cache_len, visible, depths, keys, values,
               in_place: bool, span_kernel: bool = False) -> tuple[LowerState, KeyValues]:
    """The main stream through layers [0, N - N_s) for T new rows with `visible` [T, T] among them at
    `depths` past cache_len, and the provider that collects their K/V."""
    count = ids.shape[1]
    positions = (cache_len + depths)[None]
    past = split_cache(keys, values)
    span = keys_rows(keys)  # C, or fewer on ONNX Runtime (static_graph.span_rows)
    among = tree_mask(visible)
    if span_kernel:  # [T, T]: the kernel reads the cache below cache_len itself
        mask, provider = among[None, None], SpanKeyValues(len(past), count, (keys, values), cache_len)
    elif in_place:  # [T, C]: the cache below cache_len, then the new rows at their slots
        inside, index = in_place_slots(cache_len, span, count)
        mask = torch.where(inside[None, :], among.index_select(1, index), cache_mask(cache_len, span, count))[None, None]
        provider = StepKeyValues(len(past), count, past, write_at=cache_len,
                                 order=decode_order(cache_len, visible, depths, span))
    else:  # [T, C + T]
        mask = torch.cat([cache_mask(cache_len, span, count), among], dim=1)[None, None]
        provider = StepKeyValues(len(past), count, past)
    return model.forward_lower(ids, positions, mask, provider), provider


class MainPass(nn.Module):
    """prefill or decode: the main stream over a causal chunk of T new tokens (a constant chain)."""

    def __init__(self, model: SpeculativeStreamingLM, count: int, select_last: bool, in_place: bool = False,
                 span: bool = False):
        super().__init__()
        self.model = model
        self.select_last = select_last
        self.in_place, self.span = in_place, span
        # Not named like the step graphs' inputs: ONNX keeps constants by name beside the methods' inputs.
        self.register_buffer("chain_visible", chain_visibility(count).to(torch.float32), persistent=False)
        self.register_buffer("chain_depths", torch.arange(count), persistent=False)

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                last: torch.Tensor | None = None):
        lower, provider = main_lower(self.model, ids, cache_len, self.chain_visible, self.chain_depths, keys, values,
                                     self.in_place, self.span)
        hidden = self.model.forward_upper(lower).hidden[0]
        anchor = lower.hidden[0]
        if self.select_last:  # prefill: only the last real prompt token matters to the host
            hidden, anchor = hidden.index_select(0, last), anchor.index_select(0, last)
        return (self.model.logits(hidden), anchor, hidden, *new_rows(provider))


class StepPass(nn.Module):
    """step: the main stream over a draft tree of T rows, the tree given as inputs."""

    def __init__(self, model: SpeculativeStreamingLM, in_place: bool = False, span: bool = False):
        super().__init__()
        self.model = model
        self.in_place, self.span = in_place, span

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, tree: torch.Tensor, depths: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor):
        lower, provider = main_lower(self.model, ids, cache_len, tree, depths, keys, values, self.in_place, self.span)
        hidden = self.model.forward_upper(lower).hidden[0]
        return (self.model.logits(hidden), lower.hidden[0], hidden, *new_rows(provider))


def new_rows(provider: StepKeyValues) -> tuple[torch.Tensor, torch.Tensor]:
    """This call's main-token K/V as [L, kv, T, d] keys and values."""
    return torch.cat([k for k, _ in provider.new]), torch.cat([v for _, v in provider.new])


class StreamsPass(nn.Module):
    """streams: the gamma streams of the node committed last, whose state at layer N - N_s is `anchor`."""

    def __init__(self, model: SpeculativeStreamingLM, span: bool = False):
        super().__init__()
        self.model, self.span = model, span

    def forward(self, anchor: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        position = (cache_len - 1)[None]
        past = split_cache(keys, values)
        if self.span:  # the cache is the kernel's; the streams see no other rows of the call
            past_mask, provider = torch.zeros(1, 1, 1, 0), SpanKeyValues(len(past), 0, (keys, values), cache_len)
        else:
            past_mask = cache_mask(cache_len, keys_rows(keys), 1)[None, None]
            provider = StepKeyValues(len(past), 0, past)
        streams = self.model.forward_streams(anchor[None], position, past_mask, provider)[0, 0]
        return self.model.logits(streams), streams


class HeadsPass(nn.Module):
    """heads: Medusa's heads at the node committed at row cache_len - 1, whose state at layer N - N_s is
    `anchor`. Its final state is recomputed, seeing the rows below (its own row comes fresh: the
    same values the cache holds)."""

    def __init__(self, model: SpeculativeStreamingLM, heads: nn.Module, span: bool = False):
        super().__init__()
        self.model, self.heads, self.span = model, heads, span

    def forward(self, anchor: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        row = cache_len - 1
        past = split_cache(keys, values)
        if self.span:  # the slots below the row, then its own K/V
            mask, provider = torch.zeros(1, 1, 1, 1), SpanKeyValues(len(past), 1, (keys, values), row)
        else:
            mask = torch.cat([cache_mask(row, keys_rows(keys), 1), torch.zeros(1, 1)], dim=1)[None, None]
            provider = StepKeyValues(len(past), 1, past)
        hidden, position = anchor[None], row[None]
        lower = LowerState(hidden, position, mask, self.model.parts.rotary(hidden, position), provider, None)
        final = self.model.forward_upper(lower).hidden[0, 0]
        return self.model.logits(self.heads(final))


class GreedyStepPass(nn.Module):
    """greedy_step: verify the tree, accept greedily, and draft from the accepted node's streams.

    schedule "deferred" runs the accepted node's gamma streams after the verify pass, against the
    cache plus the tree's new rows; "fused" runs streams beside every row in the verify pass (the
    paper's schedule: more rows, but the MSA layers' weights are read once). draft_ids, if given,
    is the vocabulary streams draft from (see export/draft_vocab.py): its rows of the LM head are
    a constant of the graph, so ranking drafts reads D rows instead of V. Targets always use all V.
    """

    def __init__(self, model: SpeculativeStreamingLM, rows: int, width: int, draft_ids: Sequence[int] | None = None,
                 schedule: str = "deferred", in_place: bool = False, span: bool = False):
        super().__init__()
        if schedule not in STREAM_SCHEDULES:
            raise ValueError(f"greedy_step schedule must be one of {STREAM_SCHEDULES}, got {schedule!r}")
        self.model, self.schedule, self.width = model, schedule, width
        self.in_place, self.span = in_place, span
        self.register_buffer("all_nodes", torch.arange(rows)[None], persistent=False)
        ids = None if draft_ids is None else torch.tensor(list(draft_ids), dtype=torch.long)
        self.register_buffer("draft_ids", ids, persistent=False)
        self.draft_head = None if ids is None else head_rows(model.parts.lm_head, ids)

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, tree: torch.Tensor, depths: torch.Tensor,
                parents: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        lower, provider = main_lower(self.model, ids, cache_len, tree, depths, keys, values, self.in_place, self.span)
        fused = self.schedule == "fused"
        out = self.model.forward_upper(lower, self.all_nodes if fused else None)
        new_keys, new_values = new_rows(provider)
        targets = self.model.logits(out.hidden[0]).argmax(-1)
        accepted = accepted_node(ids[0], targets, tree, depths, parents)
        if fused:
            streams = out.stream_hidden[0].index_select(0, accepted)[0]
        else:
            anchor = lower.hidden[0].index_select(0, accepted)
            streams = self._deferred_streams(anchor, accepted, cache_len, tree, depths, keys, values, new_keys,
                                             new_values)
        return targets, accepted, self.ranked_drafts(streams), new_keys, new_values, streams

    def ranked_drafts(self, streams: torch.Tensor) -> torch.Tensor:
        """[gamma, H] final-normed stream states -> [gamma, K] token ids, best first."""
        if self.draft_ids is None:
            return self.model.logits(streams).topk(self.width, dim=-1).indices
        ranks = self.draft_head(streams).topk(self.width, dim=-1).indices
        return self.draft_ids[ranks]

    def _deferred_streams(self, anchor, node, cache_len, tree, depths, keys, values, new_keys, new_values):
        """[gamma, H] streams of `node`: it sees the cache and its tree ancestors (itself included)."""
        model = self.model
        position = (cache_len + depths.index_select(0, node))[None]
        if self.span:  # the kernel reads the cache; the step's rows come before the streams' own
            rows = [(new_keys[layer : layer + 1], new_values[layer : layer + 1]) for layer in range(len(new_keys))]
            provider = SpanKeyValues(len(rows), 0, (keys, values), cache_len, prefix=rows)
            visible = tree_mask(tree.index_select(0, node))
            return model.forward_streams(anchor[None], position, visible[None, None], provider)[0, 0]
        visible = torch.cat([cache_mask(cache_len, keys_rows(keys), 1), tree_mask(tree.index_select(0, node))], dim=1)
        past = [(layer_keys, layer_values) if layer < model.split else
                (torch.cat([layer_keys, new_keys[layer : layer + 1]], dim=2),
                 torch.cat([layer_values, new_values[layer : layer + 1]], dim=2))
                for layer, (layer_keys, layer_values) in enumerate(split_cache(keys, values))]
        provider = StepKeyValues(len(past), 0, past)
        return model.forward_streams(anchor[None], position, visible[None, None], provider)[0, 0]


def accepted_node(ids: torch.Tensor, targets: torch.Tensor, tree: torch.Tensor, depths: torch.Tensor,
                  parents: torch.Tensor) -> torch.Tensor:
    """[1]: the deepest node whose every ancestor's target is its child's token (runtime/accept.py's greedy
    rule; sibling tokens are distinct, so at most one node per depth qualifies). Rows are weighed by
    depth + 1, so the root (1) always beats a pad row (depth -1: 0)."""
    matched = torch.cat([torch.ones(1, dtype=torch.bool, device=ids.device),
                         ids[1:] == targets.index_select(0, parents[1:])])
    # A [T, 1] column: Core ML's matmul does not take a rank-1 right operand.
    misses = tree @ torch.logical_not(matched).to(torch.float32)[:, None]
    reachable = (misses[:, 0] == 0).to(torch.long)
    return (reachable * (depths + 1)).argmax(0, keepdim=True)


def head_rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """The LM head restricted to rows `ids` (the draft vocabulary): a low-bit head keeps its codes; a
    float head (a torchao-quantized one dequantized: drafts only) becomes a float linear layer."""
    if hasattr(head, "rows"):  # Q8Linear, XnnpackQ8Head
        return head.rows(ids)
    weight = head.weight.detach()
    if type(weight) is not torch.Tensor and hasattr(weight, "dequantize"):
        weight = weight.dequantize()
    rows = nn.Linear(weight.shape[1], len(ids), bias=False)
    # A parameter: XNNPACK lowers a linear layer only when its weight is one.
    rows.weight = nn.Parameter(weight.float()[ids].clone(), requires_grad=False)
    return rows


# Largest bucket whose greedy_step runs streams beside every row under "auto". On the 2-core CPU
# (ONNX Runtime, SmolLM2-135M, N_s 8, gamma 3; tools/graph_latency.py) fused/deferred took
# 47.7/52.3 ms for the 4-node chain and 81.6/69.2 ms for 15 nodes (a 6-node tree was about even in
# an exploratory run): extra rows cost compute, re-reading the MSA layers' weights costs bandwidth.
FUSED_MAX_NODES = 7
GREEDY_SCHEDULES = ("auto", *STREAM_SCHEDULES)


def greedy_schedule(rows: int, choice: str) -> str:
    """"fused" or "deferred" for the greedy_step of `rows` rows; "auto" picks by size (FUSED_MAX_NODES)."""
    if choice not in GREEDY_SCHEDULES:
        raise ValueError(f"greedy_step schedule must be one of {', '.join(GREEDY_SCHEDULES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "fused" if rows <= FUSED_MAX_NODES else "deferred"


def chain_visibility(count: int) -> torch.Tensor:
    return torch.ones(count, count, dtype=torch.bool).tril()


def graph_modules(model: SpeculativeStreamingLM, shapes: GraphShapes, draft_ids: Sequence[int] | None = None,
                  schedules: Sequence[str] | None = None, heads: nn.Module | None = None) -> dict[str, nn.Module]:
    """method name -> module, in static_graph.method_names order; the same model weights are shared by
    all of them. draft_ids and schedules (one per bucket; default deferred) shape greedy_step only;
    heads (Medusa's) add the heads method."""
    chunk, in_place, span = shapes.prefill_chunk, shapes.in_place, shapes.span
    schedules = schedules or ["deferred"] * len(shapes.buckets)
    modules = {
        "prefill": MainPass(model, chunk, True, in_place, span),
        "decode": MainPass(model, 1, False, in_place, span),
        "streams": StreamsPass(model, span),
    }
    for rows, schedule in zip(shapes.buckets, schedules, strict=True):
        modules[bucket_method("step", rows)] = StepPass(model, in_place, span)
        modules[bucket_method("greedy_step", rows)] = GreedyStepPass(model, rows, shapes.width, draft_ids, schedule,
                                                                     in_place, span)
    if heads is not None:
        modules["heads"] = HeadsPass(model, heads, span)
    return modules


def graph_spec(model: SpeculativeStreamingLM, shapes: GraphShapes, schedules: Sequence[str],
               heads: int = 0) -> GraphSpec:
    """What the host must know to run graph_modules(model, shapes, ..., schedules) (and `heads` Medusa heads)."""
    parts = model.parts
    return GraphSpec(parts.num_layers, parts.num_kv_heads, parts.head_dim, parts.vocab_size, model.num_streams,
                     shapes.capacity, shapes.prefill_chunk, shapes.buckets, tuple(schedules), shapes.width, heads)


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
    return inputs


def names_of(methods) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Input and output tensor names of each exported method (a bucket's: those of step / greedy_step)."""
    return ({m: INPUT_NAMES[base_method(m)] for m in methods}, {m: OUTPUT_NAMES[base_method(m)] for m in methods})


def signature(modules: dict[str, nn.Module], inputs: dict[str, tuple[torch.Tensor, ...]]) -> dict:
    """Per method: input and output names, shapes and dtypes (for the manifest and for checks)."""
    result = {}
    with torch.no_grad():
        for name, module in modules.items():
            outputs = module(*inputs[name])
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            result[name] = {
                "inputs": [_describe(n, t) for n, t in zip(INPUT_NAMES[base_method(name)], inputs[name])],
                "outputs": [_describe(n, t) for n, t in zip(OUTPUT_NAMES[base_method(name)], outputs)],
            }
    return result


def _describe(name: str, tensor: torch.Tensor) -> dict:
    return {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
