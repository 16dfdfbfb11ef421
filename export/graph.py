"""Static-shape graphs of a Speculative Streaming model: what ExecuTorch, ONNX and Core ML compile.

Every method is a pure function of explicit tensors; the host owns the KV cache:

    prefill(ids [1,P], cache_len [1], last [1], keys, values) -> logits [1,V], anchor [1,H], hidden [1,H],
                                                                  new_keys, new_values
    decode (ids [1,1], cache_len [1], keys, values)            -> logits [1,V], anchor [1,H], hidden [1,H],
                                                                  new_keys, new_values
    step_i (ids [1,T], cache_len [1], keys, values)            -> logits [T,V], anchor [T,H], hidden [T,H],
                                                                  new_keys, new_values
    streams(anchor [1,H], cache_len [1], keys, values)         -> stream_logits [gamma,V]
    greedy_step_i(ids [1,T], cache_len [1], keys, values)      -> targets [T], accepted [1], drafts [gamma,K],
                                                                  new_keys, new_values
    heads  (anchor [1,H], cache_len [1], keys, values)         -> head_logits [heads,V]   (Medusa heads only)
step_i and greedy_step_i exist for each draft tree i the artifact carries (T: that tree's nodes;
calibration picks one per device, runtime/calibration.py).

keys/values [L, kv_heads, C, d] hold the committed cache: rows < cache_len are attended to,
the rest are masked out, so C (the capacity) is the only cache shape a graph ever sees.
new_keys/new_values [L, kv_heads, T, d] are this call's rows; the host copies the accepted
ones into its cache. The step graph's tree (visibility among its T nodes and their depths) is
a constant folded into the graph; prefill is a causal chunk of P tokens (a chain), decode a
chain of 1. anchor is each row's main-stream state at layer N - N_s: the streams method runs
the gamma streams of the last accepted node after its commit (the deferred schedule, whose
outputs equal the fused pass's; on CPUs it is the cheaper one). hidden is each row's final-normed
state, the logits' input: a draft model's SpecDec++ acceptance head reads it (method specdec++).

heads (an artifact with Medusa heads, method medusa) reruns the top N_s layers for the node committed
at row cache_len - 1 (its anchor), seeing the rows below it, and ranks its final state through the
heads and the shared LM head: the step graphs stay as they are, at one extra call like the streams'.

greedy_step is step + streams in one call for greedy decoding: the graph takes each node's
argmax (targets), finds the accepted node by the greedy rule, and returns the top-K token ids
(K: the widest level of any of the artifact's trees, so the next step may take any) of that
node's streams, run beside every node (fused) or for that node alone after verifying (deferred);
see GreedyStepPass. One call per step, and no [T, V]
logits leave the graph. The host still decides acceptance from `targets`; `accepted` only says
whose streams the drafts are. streams and greedy_step also return the streams' final-normed states
[gamma, H] (stream_states): method ss-adaptive's acceptance head reads them on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from streamfuse.adapters.masks import GRAPH_MASKED, additive
from streamfuse.adapters.model import LowerState, SpeculativeStreamingLM
from streamfuse.adapters.msa import StepKeyValues, in_place_slots
from streamfuse.runtime.backends.base import STREAM_SCHEDULES
from streamfuse.runtime.backends.static_graph import INPUT_NAMES, OUTPUT_NAMES, GraphSpec, base_method, tree_method
from streamfuse.runtime.tree import TreeSpec

# The K or V cache as a graph input: one [L, kv, C, d] tensor, or L tensors [1, kv, C, d].
Cache = torch.Tensor | list[torch.Tensor]


@dataclass(frozen=True)
class GraphShapes:
    """The static sizes every exported method is traced with."""

    capacity: int  # C: KV rows the graphs attend over (prompt + generated + one step)
    prefill_chunk: int  # P: prompt tokens per prefill call
    trees: tuple[TreeSpec, ...]  # the draft trees with step graphs (T = tree.num_nodes), the default first
    # Where a call's new rows sit for attention: False, after the C cache rows; True, at slots
    # cache_len.. of the cache (MainPass): a chain node then sees exactly what plain decoding of its
    # token sees, slot for slot, so reductions add the same terms in the same order (ONNX Runtime's
    # sums depend on where the terms sit, and int8 activations would turn 1-ulp differences into flips).
    in_place: bool = False

    def __post_init__(self):
        if not self.trees:
            raise ValueError("the graphs need at least one draft tree")
        if len({tree.hash() for tree in self.trees}) != len(self.trees):
            raise ValueError("the draft trees repeat a shape: give each tree once")
        largest = max(tree.num_nodes for tree in self.trees)
        if self.prefill_chunk < 1 or self.capacity < self.prefill_chunk + largest:
            raise ValueError(f"capacity {self.capacity} must hold at least one prefill chunk ({self.prefill_chunk}) "
                             f"plus one tree ({largest} nodes)")


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


class MainPass(nn.Module):
    """prefill, decode or step: main stream over T new tokens with a constant visibility among them."""

    def __init__(self, model: SpeculativeStreamingLM, visibility: torch.Tensor, depths: list[int], select_last: bool,
                 in_place: bool = False):
        super().__init__()
        self.model = model
        self.select_last = select_last
        self.in_place = in_place
        self.register_buffer("tree_mask", additive(visibility, fill=GRAPH_MASKED), persistent=False)
        self.register_buffer("depths", torch.tensor(depths, dtype=torch.long), persistent=False)

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                last: torch.Tensor | None = None):
        lower, provider = self.lower(ids, cache_len, keys, values)
        hidden = self.model.forward_upper(lower).hidden[0]
        anchor = lower.hidden[0]
        if self.select_last:  # prefill: only the last real prompt token matters to the host
            hidden, anchor = hidden.index_select(0, last), anchor.index_select(0, last)
        return (self.model.logits(hidden), anchor, hidden, *new_rows(provider))

    def lower(self, ids, cache_len, keys, values) -> tuple[LowerState, StepKeyValues]:
        """The main stream through layers [0, N - N_s), and the provider that collects new K/V."""
        count = ids.shape[1]
        positions = (cache_len + self.depths)[None]
        past = split_cache(keys, values)
        span = past[0][0].shape[2]  # C; an ONNX prefill takes only the rows up to its own (to_onnx.DYNAMIC_SPAN)
        if self.in_place:  # [T, C]: the cache below cache_len, then the tree at its slots
            inside, index = in_place_slots(cache_len, span, count)
            mask = torch.where(inside[None, :], self.tree_mask.index_select(1, index),
                               cache_mask(cache_len, span, count))[None, None]
            provider = StepKeyValues(len(past), count, past, write_at=cache_len)
        else:  # [T, C + T]
            mask = torch.cat([cache_mask(cache_len, span, count), self.tree_mask], dim=1)[None, None]
            provider = StepKeyValues(len(past), count, past)
        return self.model.forward_lower(ids, positions, mask, provider), provider


def new_rows(provider: StepKeyValues) -> tuple[torch.Tensor, torch.Tensor]:
    """This call's main-token K/V as [L, kv, T, d] keys and values."""
    return torch.cat([k for k, _ in provider.new]), torch.cat([v for _, v in provider.new])


class StreamsPass(nn.Module):
    """streams: the gamma streams of the node committed last, whose state at layer N - N_s is `anchor`."""

    def __init__(self, model: SpeculativeStreamingLM, capacity: int):
        super().__init__()
        self.model = model
        self.capacity = capacity

    def forward(self, anchor: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        position = (cache_len - 1)[None]
        past_mask = cache_mask(cache_len, self.capacity, 1)[None, None]
        provider = StepKeyValues(len(keys), 0, split_cache(keys, values))
        streams = self.model.forward_streams(anchor[None], position, past_mask, provider)[0, 0]
        return self.model.logits(streams), streams


class HeadsPass(nn.Module):
    """heads: Medusa's heads at the node committed at row cache_len - 1, whose state at layer N - N_s is
    `anchor`. Its final state is recomputed, seeing the rows below (its own row comes fresh: the
    same values the cache holds)."""

    def __init__(self, model: SpeculativeStreamingLM, heads: nn.Module, capacity: int):
        super().__init__()
        self.model, self.heads, self.capacity = model, heads, capacity

    def forward(self, anchor: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        row = cache_len - 1
        mask = torch.cat([cache_mask(row, self.capacity, 1), torch.zeros(1, 1)], dim=1)[None, None]
        provider = StepKeyValues(len(keys), 1, split_cache(keys, values))
        hidden, position = anchor[None], row[None]
        lower = LowerState(hidden, position, mask, self.model.parts.rotary(hidden, position), provider, None)
        final = self.model.forward_upper(lower).hidden[0, 0]
        return self.model.logits(self.heads(final))


class GreedyStepPass(nn.Module):
    """greedy_step: verify the tree, accept greedily, and draft from the accepted node's streams.

    schedule "deferred" runs the accepted node's gamma streams after the verify pass, against the
    cache plus the tree's new rows; "fused" runs streams beside every node in the verify pass (the
    paper's schedule: more rows, but the MSA layers' weights are read once). draft_ids, if given,
    is the vocabulary streams draft from (see export/draft_vocab.py): its rows of the LM head are
    a constant of the graph, so ranking drafts reads D rows instead of V. Targets always use all V.
    """

    def __init__(self, model: SpeculativeStreamingLM, tree: TreeSpec, capacity: int,
                 draft_ids: Sequence[int] | None = None, schedule: str = "deferred", in_place: bool = False,
                 width: int | None = None):
        super().__init__()
        if schedule not in STREAM_SCHEDULES:
            raise ValueError(f"greedy_step schedule must be one of {STREAM_SCHEDULES}, got {schedule!r}")
        self.model, self.capacity, self.schedule = model, capacity, schedule
        # Drafts for the next step, whichever tree it takes: the widest level of all the artifact's trees.
        self.width = width or max(tree.widths)
        self.main = MainPass(model, tree.ancestor_mask, tree.depths, select_last=False, in_place=in_place)
        self.register_buffer("parents", torch.tensor(tree.parents[1:], dtype=torch.long), persistent=False)
        self.register_buffer("ancestors", tree.ancestor_mask.to(torch.float32), persistent=False)
        self.register_buffer("all_nodes", torch.arange(tree.num_nodes)[None], persistent=False)
        ids = None if draft_ids is None else torch.tensor(list(draft_ids), dtype=torch.long)
        self.register_buffer("draft_ids", ids, persistent=False)
        self.draft_head = None if ids is None else head_rows(model.parts.lm_head, ids)

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        lower, provider = self.main.lower(ids, cache_len, keys, values)
        fused = self.schedule == "fused"
        out = self.model.forward_upper(lower, self.all_nodes if fused else None)
        new_keys, new_values = new_rows(provider)
        targets = self.model.logits(out.hidden[0]).argmax(-1)
        accepted = self.accepted_node(ids[0], targets)
        if fused:
            streams = out.stream_hidden[0].index_select(0, accepted)[0]
        else:
            anchor = lower.hidden[0].index_select(0, accepted)
            streams = self._deferred_streams(anchor, accepted, cache_len, keys, values, new_keys, new_values)
        return targets, accepted, self.ranked_drafts(streams), new_keys, new_values, streams

    def accepted_node(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[1]: the deepest node whose every ancestor's target is its child's token (runtime/accept.py's
        greedy rule; sibling tokens are distinct, so at most one node per depth qualifies)."""
        matched = torch.cat([torch.ones(1, dtype=torch.bool, device=ids.device), ids[1:] == targets[self.parents]])
        # A [T, 1] column: Core ML's matmul does not take a rank-1 right operand.
        misses = self.ancestors @ torch.logical_not(matched).to(torch.float32)[:, None]
        reachable = (misses[:, 0] == 0).to(torch.long)
        return (reachable * (self.main.depths + 1)).argmax(0, keepdim=True)

    def ranked_drafts(self, streams: torch.Tensor) -> torch.Tensor:
        """[gamma, H] final-normed stream states -> [gamma, K] token ids, best first."""
        if self.draft_ids is None:
            return self.model.logits(streams).topk(self.width, dim=-1).indices
        ranks = self.draft_head(streams).topk(self.width, dim=-1).indices
        return self.draft_ids[ranks]

    def _deferred_streams(self, anchor, node, cache_len, keys, values, new_keys, new_values) -> torch.Tensor:
        """[gamma, H] streams of `node`: it sees the cache and its tree ancestors (itself included)."""
        model = self.model
        position = (cache_len + self.main.depths.index_select(0, node))[None]
        visible = torch.cat([cache_mask(cache_len, self.capacity, 1), self.main.tree_mask.index_select(0, node)], dim=1)
        past = [(layer_keys, layer_values) if layer < model.split else
                (torch.cat([layer_keys, new_keys[layer : layer + 1]], dim=2),
                 torch.cat([layer_values, new_values[layer : layer + 1]], dim=2))
                for layer, (layer_keys, layer_values) in enumerate(split_cache(keys, values))]
        provider = StepKeyValues(len(past), 0, past)
        return model.forward_streams(anchor[None], position, visible[None, None], provider)[0, 0]


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


# Largest tree whose greedy_step runs streams beside every node under "auto". On the 2-core CPU
# (ONNX Runtime, SmolLM2-135M, N_s 8, gamma 3; export/graph_latency.py) fused/deferred took
# 47.7/52.3 ms for the 4-node chain and 81.6/69.2 ms for 15 nodes (a 6-node tree was about even in
# an exploratory run): extra rows cost compute, re-reading the MSA layers' weights costs bandwidth.
FUSED_MAX_NODES = 7
GREEDY_SCHEDULES = ("auto", *STREAM_SCHEDULES)


def greedy_schedule(tree: TreeSpec, choice: str) -> str:
    """"fused" or "deferred" for greedy_step; "auto" picks by tree size (FUSED_MAX_NODES)."""
    if choice not in GREEDY_SCHEDULES:
        raise ValueError(f"greedy_step schedule must be one of {', '.join(GREEDY_SCHEDULES)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "fused" if tree.num_nodes <= FUSED_MAX_NODES else "deferred"


def chain_visibility(count: int) -> torch.Tensor:
    return torch.ones(count, count, dtype=torch.bool).tril()


def graph_modules(model: SpeculativeStreamingLM, shapes: GraphShapes, draft_ids: Sequence[int] | None = None,
                  schedules: Sequence[str] | None = None, heads: nn.Module | None = None) -> dict[str, nn.Module]:
    """method name -> module, in static_graph.method_names order; the same model weights are shared by
    all of them. draft_ids and schedules (one per tree; default deferred) shape greedy_step only;
    heads (Medusa's) add the heads method."""
    chunk, capacity, in_place = shapes.prefill_chunk, shapes.capacity, shapes.in_place
    schedules = schedules or ["deferred"] * len(shapes.trees)
    modules = {
        "prefill": MainPass(model, chain_visibility(chunk), list(range(chunk)), True, in_place),
        "decode": MainPass(model, chain_visibility(1), [0], False, in_place),
        "streams": StreamsPass(model, capacity),
    }
    width = max(max(tree.widths) for tree in shapes.trees)
    for index, (tree, schedule) in enumerate(zip(shapes.trees, schedules, strict=True)):
        modules[tree_method("step", index)] = MainPass(model, tree.ancestor_mask, tree.depths, False, in_place)
        modules[tree_method("greedy_step", index)] = GreedyStepPass(model, tree, capacity, draft_ids, schedule, in_place,
                                                                    width)
    if heads is not None:
        modules["heads"] = HeadsPass(model, heads, capacity)
    return modules


def graph_spec(model: SpeculativeStreamingLM, shapes: GraphShapes, schedules: Sequence[str],
               heads: int = 0) -> GraphSpec:
    """What the host must know to run graph_modules(model, shapes, ..., schedules) (and `heads` Medusa heads)."""
    parts = model.parts
    return GraphSpec(parts.num_layers, parts.num_kv_heads, parts.head_dim, parts.vocab_size, model.num_streams,
                     shapes.capacity, shapes.prefill_chunk, shapes.trees, tuple(schedules), heads)


def example_inputs(model: SpeculativeStreamingLM, shapes: GraphShapes) -> dict[str, tuple[torch.Tensor, ...]]:
    """Inputs with the exported shapes and dtypes (values are arbitrary but valid)."""
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
    for index, tree in enumerate(shapes.trees):
        for method in ("step", "greedy_step"):
            inputs[tree_method(method, index)] = (ids(tree.num_nodes), length, keys, values)
    return inputs


def names_of(methods) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Input and output tensor names of each exported method (a tree's methods: those of step / greedy_step)."""
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
