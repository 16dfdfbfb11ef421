"""Attention for the graphs ONNX Runtime runs: standard ops, exact per row.

HF's attention repeats K/V per query head and takes a one-row call through other kernels than a bigger
one; on ONNX Runtime a row's sums would then depend on the call it is in. grouped_attention stacks the
query heads of one K/V head as rows instead (no repeat), computes a one-row product as two, and, where
the K/V provider gives plain decoding's order of each row's keys (the in-place layout), runs each row's
softmax in that order and sums probs x values over the slots in one pass (decode_ordered), so each row of
a tree is plain decoding of its path bit for bit (docs/export.md). ExecuTorch's graphs use the span
kernel instead (span_attention.py).
"""

from __future__ import annotations

import copy

import torch

from streamfuse.adapters import hf
from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.msa import KeyValues, StepKeyValues

ATTENTION = "streamfuse_grouped_bmm"


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention for an HF attention module (AttentionInterface signature), without repeating K/V:
    the query heads of one K/V head are stacked as rows. query [B, heads, T, d], key / value
    [B, kv_heads, K, d], attention_mask additive [B, 1, T, K] -> ([B, T, heads, d], None).

    A product of one row is computed as two (the row twice): ONNX Runtime's MatMul gives a
    one-row probs x values another result than the same row inside a bigger call (1e-6; measured,
    docs/export.md), and SS == plain decoding needs each row's result whatever the call's size.
    Where the K/V provider gives plain decoding's order of each row's keys (the in-place layout, ONNX),
    the softmax runs over the scores in that order and probs x values sums every slot in one pass,
    so a tree row's sums are plain decoding's term for term (decode_ordered)."""
    active = KeyValues.take_active(getattr(module, "layer_idx", None))
    order = active.order if isinstance(active, StepKeyValues) else None
    batch, heads, tokens, size = query.shape
    kv_heads = key.shape[1]
    rows, mask = stacked_rows(query, kv_heads, scaling), attention_mask
    single = rows.shape[1] == 1
    if single:
        rows, mask = torch.cat([rows, rows], dim=1), None if mask is None else torch.cat([mask, mask], dim=2)
    scores = grouped_scores(rows, key, mask, heads // kv_heads)
    if order is None:
        probs = torch.softmax(scores, dim=-1).reshape(rows.shape[0], rows.shape[1], scores.shape[-1])
        out = torch.bmm(probs, value.reshape(rows.shape[0], -1, size))
    else:
        out = decode_ordered(scores, value, order)
    if single:
        out = out[:, :1]
    return out.reshape(batch, heads, tokens, size).transpose(1, 2), None


SLOT_COLUMNS = 16  # probs x values in column blocks this wide: ONNX Runtime's fp32 GEMM then sums up to
# 1,024 slots in one pass, in slot order (at 64 columns it sums blocks of 256 slots, then adds the blocks)


def decode_ordered(scores: torch.Tensor, value: torch.Tensor, order: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Softmax over each main row's scores in plain decoding's order (runtime/backends/graph_passes.py decode_order: the
    row's ancestors at their depths), the probabilities back at their slots, then probs x values in
    SLOT_COLUMNS-wide blocks. scores [B, kv, group, T', K] (K: the C slots, then stream keys), value
    [B, kv, K, d] -> [B·kv, group·T', d]."""
    batch, kv_heads, group, tokens, keys = scores.shape
    source, place = (ordered_index(index, tokens, keys) for index in order)
    edge = scores.new_full((batch, kv_heads, group, tokens, 1), GRAPH_MASKED)
    shape = (batch, kv_heads, group, tokens, keys)
    ordered = torch.cat([scores, edge], dim=-1).gather(-1, source.expand(shape))
    probs = torch.softmax(ordered, dim=-1)
    probs = torch.cat([probs, torch.zeros_like(edge)], dim=-1).gather(-1, place.expand(shape))
    size = value.shape[-1]
    blocks = size // SLOT_COLUMNS if size % SLOT_COLUMNS == 0 else 1
    split = value.reshape(batch * kv_heads, keys, blocks, size // blocks).permute(0, 2, 1, 3)
    out = torch.matmul(probs.reshape(batch * kv_heads, 1, group * tokens, keys), split)
    return out.permute(0, 2, 1, 3).reshape(batch * kv_heads, group * tokens, size)


def ordered_index(index: torch.Tensor, tokens: int, keys: int) -> torch.Tensor:
    """A decode_order index [T, C] as a gather index [T', K] over K + 1 columns: -1 -> K (the extra
    column: a masked score, a zero probability), keys past C and rows past T (streams) in place."""
    main, span = index.shape
    if keys > span:
        index = torch.cat([index, torch.arange(span, keys, device=index.device).expand(main, keys - span)], dim=1)
    index = torch.where(index < 0, keys, index)
    if tokens > main:
        index = torch.cat([index, torch.arange(keys, device=index.device).expand(tokens - main, keys)], dim=0)
    return index


def stacked_rows(query: torch.Tensor, kv_heads: int, scaling: float) -> torch.Tensor:
    """query [B, heads, T, d] scaled -> [B·kv_heads, group·T, d]: the query heads of a K/V head as rows
    (HF orders heads kv-major: head h reads K/V head h // group)."""
    batch, heads, tokens, size = query.shape
    scale = torch.tensor(scaling, dtype=query.dtype)  # a tensor: XNNPACK multiplies tensors, not scalars
    return (query * scale).reshape(batch * kv_heads, (heads // kv_heads) * tokens, size)


def grouped_scores(rows: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, group: int) -> torch.Tensor:
    """stacked_rows [B·kv, group·T, d], key [B, kv, K, d], additive mask [B, 1, T, K] or None -> [B, kv, group, T, K]."""
    batch, kv_heads, keys, size = key.shape
    scores = torch.bmm(rows, key.reshape(batch * kv_heads, keys, size).transpose(1, 2))
    scores = scores.reshape(batch, kv_heads, group, rows.shape[1] // group, keys)
    return scores if mask is None else scores + mask.reshape(mask.shape[0], mask.shape[1], 1, -1, keys)


def with_graph_attention(model: SpeculativeStreamingLM, name: str = ATTENTION, function=grouped_attention
                         ) -> SpeculativeStreamingLM:
    """A copy of `model` whose attention is `function` (default grouped_attention: ONNX's row-invariant attention)."""
    hf.register_attention(name, function)
    ready = copy.deepcopy(model)
    hf.set_attention(ready.model, name)
    return ready
