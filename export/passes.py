"""The graphs' functions as torch modules: what export/ traces into static-shape graphs and what the torch
backend runs eagerly (export/eager.py). Their inputs and outputs are the contract's (runtime/artifact/contract.py
INPUT_NAMES, OUTPUT_NAMES); export/graph.py says what each computes.

A layout says where a call's new rows sit for attention:
- "append": after the cache rows given (all C, or fewer: the graph reads the count from its inputs);
- "span": read by the exact kernel over the cache's used span (export/span_attention.py), which also writes
  them into slots cache_len.. of the given cache in place; the call first moves the rows the host accepted from
  the previous call into place (its commit input, runtime/ops/tree_attention.py commit_rows), and returns no rows;
- "scratch" (eager only): written into the given cache's free slots cache_len.. in place, attention reading
  a view of slots [0, cache_len + T): no copy of the cache, and the host's commit moves the accepted rows
  down. The passes then also read only the used span for the streams and heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.model import LowerState, SpeculativeStreamingLM
from streamfuse.adapters.msa import KeyValues, ScratchKeyValues, SpanKeyValues, StepKeyValues
from streamfuse.runtime.artifact.contract import STREAM_SCHEDULES
from streamfuse.runtime.ops.tree_attention import commit_op

Cache = torch.Tensor  # the K or V cache as a graph input: [L, kv, C, d]
APPEND, SPAN, SCRATCH = "append", "span", "scratch"
LAYOUTS = (APPEND, SPAN, SCRATCH)


def cache_mask(cache_len: torch.Tensor, capacity: int, rows: int) -> torch.Tensor:
    """[rows, C] additive: cache row c is visible iff c < cache_len."""
    hidden = torch.arange(capacity, device=cache_len.device)[None, :] >= cache_len[:, None]
    # A product, not torch.where with a scalar: Core ML's converter has no where.ScalarOther.
    return (hidden.to(torch.float32) * GRAPH_MASKED).expand(rows, capacity)


def split_cache(keys: Cache, values: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache per layer ([1, kv, C, d] keys and values) as the model's K/V provider reads it."""
    # Slices, not index + unsqueeze: XNNPACK takes slices, so they do not split its partitions.
    return [(keys[layer : layer + 1], values[layer : layer + 1]) for layer in range(keys.shape[0])]


def keys_rows(keys: Cache) -> int:
    """The cache rows a call was given (C; the scratch layout's views: fewer)."""
    return keys.shape[2]


def tree_mask(visible: torch.Tensor) -> torch.Tensor:
    """Additive [T, T] from 0/1 visibility. A product, not torch.where with a scalar (Core ML's converter
    has no where.ScalarOther); a visible entry becomes -0.0, which adds to a score like 0.0."""
    return (1.0 - visible) * GRAPH_MASKED


def committed(
    keys: Cache, values: Cache, cache_len: torch.Tensor, commit: torch.Tensor | None, layout: str
) -> torch.Tensor:
    """cache_len once the previous call's accepted rows are in place: the span graphs move them first (commit_rows)
    and every attention takes its output as `start`, so on every engine it runs after the move."""
    if layout != SPAN:
        return cache_len
    if commit is None:
        raise ValueError("the span layout's graphs take the commit input (contract.COMMIT_INPUT)")
    return commit_op()(keys, values, cache_len, commit)


def main_lower(
    model: SpeculativeStreamingLM,
    ids,
    cache_len,
    visible,
    depths,
    keys,
    values,
    layout: str,
    with_pruning: bool = False,
    commit: torch.Tensor | None = None,
) -> tuple[LowerState, KeyValues]:
    """The main stream through layers [0, N - N_s) for T new rows with `visible` [T, T] among them at
    `depths` past cache_len, and the provider that collects their K/V (span: and writes them into the cache)."""
    count = ids.shape[1]
    positions = (cache_len + depths)[None]
    past = split_cache(keys, values)
    among = tree_mask(visible)
    if layout == SPAN:  # [T, T]: the kernel reads the cache below cache_len itself, and writes the rows after it
        start = committed(keys, values, cache_len, commit, layout)
        mask, provider = among[None, None], SpanKeyValues(len(past), count, (keys, values), start, store=True)
    elif layout == SCRATCH:  # [T, cache_len + T]: the used cache, then the new rows in the slots after it
        start = int(cache_len[0])
        mask = as_scores(torch.cat([among.new_zeros(count, start), among], dim=1), keys, layout)[None, None]
        provider = ScratchKeyValues(len(past), count, (keys, values), start)
    else:  # [T, C + T]
        mask = torch.cat([cache_mask(cache_len, keys_rows(keys), count), among], dim=1)[None, None]
        provider = StepKeyValues(len(past), count, past)
    return model.forward_lower(ids, positions, mask, provider, with_pruning), provider


def used_cache(keys: Cache, values: Cache, cache_len: torch.Tensor, layout: str) -> tuple[Cache, Cache]:
    """The cache rows a streams or heads call reads: all it was given, or (scratch) views of the used ones,
    so attention never sees a free slot."""
    if layout != SCRATCH:
        return keys, values
    used = int(cache_len[0])
    return keys[:, :, :used], values[:, :, :used]


class MainPass(nn.Module):
    """decode: the main stream over a causal chunk of T new tokens (a constant chain)."""

    def __init__(self, model: SpeculativeStreamingLM, count: int, layout: str = APPEND):
        super().__init__()
        self.model = model
        self.layout = layout
        # Not named like the step graphs' inputs: ONNX keeps constants by name beside the methods' inputs.
        self.register_buffer("chain_visible", chain_visibility(count).to(torch.float32), persistent=False)
        self.register_buffer("chain_depths", torch.arange(count), persistent=False)

    def forward(
        self,
        ids: torch.Tensor,
        cache_len: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        commit: torch.Tensor | None = None,
    ):
        return self.chain(ids, cache_len, keys, values, None, commit)

    def chain(self, ids, cache_len, keys, values, last, commit):
        lower, provider = main_lower(
            self.model, ids, cache_len, self.chain_visible, self.chain_depths, keys, values, self.layout, commit=commit
        )
        hidden = self.model.forward_upper(lower).hidden[0]
        anchor = lower.hidden[0]
        if last is not None:  # prefill: only the last real prompt token matters to the host
            hidden, anchor = hidden.index_select(0, last), anchor.index_select(0, last)
        return (self.model.logits(hidden), anchor, hidden, *new_rows(provider, self.layout))


class PrefillPass(MainPass):
    """prefill: decode over a chunk of prompt tokens, the outputs of its last real row (`last`) only."""

    def forward(
        self,
        ids: torch.Tensor,
        cache_len: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        last: torch.Tensor,
        commit: torch.Tensor | None = None,
    ):
        return self.chain(ids, cache_len, keys, values, last, commit)


class StepPass(nn.Module):
    """step: the main stream over a draft tree of T rows, the tree given as inputs."""

    def __init__(self, model: SpeculativeStreamingLM, layout: str = APPEND):
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(
        self,
        ids: torch.Tensor,
        cache_len: torch.Tensor,
        tree: torch.Tensor,
        depths: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        commit: torch.Tensor | None = None,
    ):
        return self.verify(ids, cache_len, tree, depths, keys, values, commit=commit)[0]

    def verify(self, ids, cache_len, tree, depths, keys, values, with_pruning: bool = False, commit=None):
        """(step's outputs, the lower state)."""
        lower, provider = main_lower(
            self.model, ids, cache_len, tree, depths, keys, values, self.layout, with_pruning, commit
        )
        hidden = self.model.forward_upper(lower).hidden[0]
        return (self.model.logits(hidden), lower.hidden[0], hidden, *new_rows(provider, self.layout)), lower


class PrunedStepPass(StepPass):
    """pruned_step (eager only): step, and each node's transition probability: its token under the early-exit
    head at its parent (the root's is 1), from which the host prunes the tree (paper 3.2.3)."""

    def forward(
        self,
        ids: torch.Tensor,
        cache_len: torch.Tensor,
        tree: torch.Tensor,
        depths: torch.Tensor,
        parents: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ):
        if self.model.vocab_ids is not None:
            raise ValueError(
                "tree pruning reads the early-exit head over the whole vocabulary; this model's head "
                "keeps a subset (a draft model's): decode without --prune"
            )
        outputs, lower = self.verify(ids, cache_len, tree, depths, keys, values, with_pruning=True)
        early = lower.pruning_hidden[0].index_select(0, parents[1:])
        probs = torch.softmax(self.model.logits(early).float(), dim=-1)
        children = probs.gather(1, ids[0, 1:, None])[:, 0]
        return (*outputs, torch.cat([children.new_ones(1), children]))


def new_rows(provider: StepKeyValues, layout: str) -> tuple[torch.Tensor, ...]:
    """This call's main-token K/V as [L, kv, T, d] keys and values, the outputs that carry them to the host (the
    span layout's graphs have written them into the cache: none)."""
    if layout == SPAN:
        return ()
    return torch.cat([k for k, _ in provider.new]), torch.cat([v for _, v in provider.new])


class StreamsPass(nn.Module):
    """streams: the gamma streams of the node committed last, whose state at layer N - N_s is `anchor`."""

    def __init__(self, model: SpeculativeStreamingLM, layout: str = APPEND):
        super().__init__()
        self.model, self.layout = model, layout

    def forward(
        self,
        anchor: torch.Tensor,
        cache_len: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        commit: torch.Tensor | None = None,
    ):
        keys, values = used_cache(keys, values, cache_len, self.layout)
        position = (cache_len - 1)[None]
        past = split_cache(keys, values)
        if self.layout == SPAN:  # the cache is the kernel's; the streams see no other rows of the call
            start = committed(keys, values, cache_len, commit, self.layout)
            past_mask, provider = torch.zeros(1, 1, 1, 0), SpanKeyValues(len(past), 0, (keys, values), start)
        else:
            past_mask = as_scores(cache_mask(cache_len, keys_rows(keys), 1), keys, self.layout)[None, None]
            provider = StepKeyValues(len(past), 0, past)
        streams = self.model.forward_streams(anchor[None], position, past_mask, provider)[0, 0]
        return self.model.logits(streams), streams


class HeadsPass(nn.Module):
    """heads: Medusa's heads at the node committed at row cache_len - 1, whose state at layer N - N_s is
    `anchor`. Its final state is recomputed, seeing the rows below (its own row comes fresh: the
    same values the cache holds)."""

    def __init__(self, model: SpeculativeStreamingLM, heads: nn.Module, layout: str = APPEND):
        super().__init__()
        self.model, self.heads, self.layout = model, heads, layout

    def forward(
        self,
        anchor: torch.Tensor,
        cache_len: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        commit: torch.Tensor | None = None,
    ):
        keys, values = used_cache(keys, values, cache_len, self.layout)
        row = cache_len - 1
        past = split_cache(keys, values)
        if self.layout == SPAN:  # the slots below the row, then its own K/V (in the cache already: not stored)
            row = committed(keys, values, cache_len, commit, self.layout) - 1
            mask, provider = torch.zeros(1, 1, 1, 1), SpanKeyValues(len(past), 1, (keys, values), row)
        else:
            below = cache_mask(row, keys_rows(keys), 1)
            mask = as_scores(torch.cat([below, below.new_zeros(1, 1)], dim=1), keys, self.layout)[None, None]
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

    def __init__(
        self,
        model: SpeculativeStreamingLM,
        rows: int,
        width: int,
        draft_ids: Sequence[int] | None = None,
        schedule: str = "deferred",
        layout: str = APPEND,
    ):
        super().__init__()
        if schedule not in STREAM_SCHEDULES:
            raise ValueError(f"greedy_step schedule must be one of {STREAM_SCHEDULES}, got {schedule!r}")
        self.model, self.schedule, self.width, self.layout = model, schedule, width, layout
        self.register_buffer("all_nodes", torch.arange(rows)[None], persistent=False)
        ids = None if draft_ids is None else torch.tensor(list(draft_ids), dtype=torch.long)
        self.register_buffer("draft_ids", ids, persistent=False)
        self.draft_head = None if ids is None else head_rows(model.parts.lm_head, ids)

    def forward(
        self,
        ids: torch.Tensor,
        cache_len: torch.Tensor,
        tree: torch.Tensor,
        depths: torch.Tensor,
        parents: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        commit: torch.Tensor | None = None,
    ):
        lower, provider = main_lower(self.model, ids, cache_len, tree, depths, keys, values, self.layout, commit=commit)
        fused = self.schedule == "fused"
        out = self.model.forward_upper(lower, self.all_nodes if fused else None)
        new_keys, new_values = new_rows(provider, APPEND)
        targets = self.model.token_ids(self.model.logits(out.hidden[0]).argmax(-1))
        accepted = accepted_node(ids[0], targets, tree, depths, parents)
        if fused:
            streams = out.stream_hidden[0].index_select(0, accepted)[0]
        else:
            anchor = lower.hidden[0].index_select(0, accepted)
            streams = self._deferred_streams(
                anchor, accepted, cache_len, tree, depths, keys, values, new_keys, new_values, provider
            )
        rows = () if self.layout == SPAN else (new_keys, new_values)  # the span graphs have written them
        return targets, accepted, self.ranked_drafts(streams), *rows, streams

    def ranked_drafts(self, streams: torch.Tensor) -> torch.Tensor:
        """[gamma, H] final-normed stream states -> [gamma, K] token ids, best first."""
        if self.draft_ids is None:
            return self.model.token_ids(self.model.logits(streams).topk(self.width, dim=-1).indices)
        ranks = self.draft_head(streams).topk(self.width, dim=-1).indices
        return self.draft_ids[ranks]

    def _deferred_streams(self, anchor, node, cache_len, tree, depths, keys, values, new_keys, new_values, main):
        """[gamma, H] streams of `node`: it sees the cache and its tree ancestors (itself included); `main` is the
        verify pass's K/V provider."""
        model = self.model
        position = (cache_len + depths.index_select(0, node))[None]
        among = tree_mask(tree.index_select(0, node))
        if self.layout == SPAN:  # the kernel reads the cache; the step's rows come before the streams' own
            rows = [(new_keys[layer : layer + 1], new_values[layer : layer + 1]) for layer in range(len(new_keys))]
            provider = SpanKeyValues(len(rows), 0, (keys, values), main.start, prefix=rows)
            return model.forward_streams(anchor[None], position, among[None, None], provider)[0, 0]
        if self.layout == SCRATCH:  # the step's rows sit in the slots after the used cache already
            start = int(cache_len[0])
            past = split_cache(keys[:, :, : start + new_keys.shape[2]], values[:, :, : start + new_keys.shape[2]])
            visible = as_scores(torch.cat([among.new_zeros(1, start), among], dim=1), keys, self.layout)
        else:
            visible = torch.cat([cache_mask(cache_len, keys_rows(keys), 1), among], dim=1)
            past = [
                (layer_keys, layer_values)
                if layer < model.split
                else (
                    torch.cat([layer_keys, new_keys[layer : layer + 1]], dim=2),
                    torch.cat([layer_values, new_values[layer : layer + 1]], dim=2),
                )
                for layer, (layer_keys, layer_values) in enumerate(split_cache(keys, values))
            ]
        provider = StepKeyValues(len(past), 0, past)
        return model.forward_streams(anchor[None], position, visible[None, None], provider)[0, 0]


def as_scores(mask: torch.Tensor, keys: torch.Tensor, layout: str) -> torch.Tensor:
    """An additive mask in the cache's dtype for an eager (scratch) call, whose model may run in bf16 or fp16;
    the exported graphs are float32 and keep the mask as it is."""
    return mask.to(keys.dtype) if layout == SCRATCH else mask


def accepted_node(
    ids: torch.Tensor, targets: torch.Tensor, tree: torch.Tensor, depths: torch.Tensor, parents: torch.Tensor
) -> torch.Tensor:
    """[1]: the deepest node whose every ancestor's target is its child's token (runtime/speculation/accept.py's greedy
    rule; sibling tokens are distinct, so at most one node per depth qualifies). Rows are weighed by
    depth + 1, so the root (1) always beats a pad row (depth -1: 0)."""
    matched = torch.cat(
        [torch.ones(1, dtype=torch.bool, device=ids.device), ids[1:] == targets.index_select(0, parents[1:])]
    )
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


def chain_visibility(count: int) -> torch.Tensor:
    return torch.ones(count, count, dtype=torch.bool).tril()
