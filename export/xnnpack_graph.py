"""Keep each exported method inside a few XNNPACK partitions.

XNNPACK's partitioner takes only ops it has kernels for, and every op it refuses splits the graph:
the refused op runs on ExecuTorch's portable (single-threaded reference) kernels, and each piece
between two of them is preprocessed and called on its own. With the Hugging Face modules as they
are, SmolLM2-135M's decode method fell into 184 pieces (about 6 per layer): lowering it took
169 s (83 s in 3 pieces now) and a call 70 ms (27 ms now; docs/export.md). The refusals and
their replacements (same arithmetic):

- RMSNorm's mean over the last dim (XNNPACK means only 4D tensors over dims 2 and 3): the
  squares are reshaped to [1, rows, H, 1] and averaged over (2, 3);
- SDPA's decomposition (a "safe softmax" for fully masked rows: any / where / logical_not) and
  4D matmuls (expand_copy): attention is streamfuse's exact kernel over the cache's used span
  (export/span_attention.py), one op per layer between two XNNPACK partitions, registered into
  ExecuTorch's runtime by runtime/tree_attention.py;
- unsqueeze on any but the trailing dim (the rotary embedding's cos / sin, per layer): a view;
- alias copies of the new K/V rows: dropped.

The first two are module swaps on a copy of the model (the model itself stays as trained); the
last two rewrite the exported ATen graph. ExecuTorch parity against torch eager is checked at
export as before (export/verify.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from streamfuse.adapters import hf
from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.msa import KeyValues, StepKeyValues

ATTENTION = "streamfuse_grouped_bmm"


class PooledRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, with the mean as a 4D average over dims (2, 3)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.register_buffer("eps", torch.tensor(hf.rms_norm_epsilon(norm), dtype=norm.weight.dtype), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        size = hidden.shape[-1]
        squares = (hidden * hidden).reshape(1, -1, size, 1)
        variance = squares.mean(dim=(2, 3), keepdim=True).reshape(*hidden.shape[:-1], 1)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps))


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
    """Softmax over each main row's scores in plain decoding's order (export/graph.py decode_order: the
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


def xnnpack_model(model: SpeculativeStreamingLM) -> SpeculativeStreamingLM:
    """A copy of `model` whose RMSNorms lower to XNNPACK whole and whose attention is the span kernel (its
    graphs need GraphShapes.span)."""
    ready = span_model(model)
    ready.replace_modules(hf.is_rms_norm, PooledRMSNorm)
    return ready


def span_model(model: SpeculativeStreamingLM) -> SpeculativeStreamingLM:
    """A copy of `model` whose attention is the exact span kernel (export/span_attention.py)."""
    from streamfuse.export import span_attention

    return with_graph_attention(model, span_attention.register(), span_attention.span_attention)


def with_graph_attention(model: SpeculativeStreamingLM, name: str = ATTENTION, function=grouped_attention
                         ) -> SpeculativeStreamingLM:
    """A copy of `model` whose attention is `function` (default grouped_attention: ONNX's row-invariant attention)."""
    hf.register_attention(name, function)
    ready = copy.deepcopy(model)
    hf.set_attention(ready.model, name)
    return ready


def views_for_xnnpack(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """In place on the ATen graph: unsqueeze -> view of the same shape, alias -> its input."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.target == torch.ops.aten.unsqueeze.default:
            node.target = torch.ops.aten.view.default
            node.args = (node.args[0], list(node.meta["val"].shape))
        elif node.target == torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    program.graph_module.recompile()
    return program
