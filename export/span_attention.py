"""Attention over the used span of the cache, for the exported graphs (ExecuTorch, ONNX Runtime): HF's attention
interface backed by the exact kernel (runtime/ops/tree_attention.py). The layer's cache and `start` come from the
SpanKeyValues provider (adapters/msa.py); the keys HF hands over are the call's own rows, and the mask
[1, 1, rows, those rows] says which each row sees. The kernel writes the provider's `stored` first rows into the
cache at slots start.. (the engine keeps the cache). A row's result is bit-identical whatever the call's size
and tree, and equal to plain decoding's for a chain node; a call's cost grows with the used span, not with
the cache's capacity, and the cache is never concatenated with the new rows. A batched step's provider
(BatchSpanKeyValues) has one cache, start and mask per sequence: the kernel runs once per sequence, on its rows.
"""

from __future__ import annotations

import copy

import torch

from streamfuse.adapters import hf
from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.msa import BatchSpanKeyValues, KeyValues, SpanKeyValues
from streamfuse.runtime.ops.tree_attention import torch_op

SPAN_ATTENTION = "streamfuse_span"


def span_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """query [1, heads, rows, d]; key / value [1, kv, X, d] the call's rows; attention_mask additive
    [1, 1, rows, X] -> ([1, rows, heads, d], None)."""
    provider = KeyValues.take_active(module.layer_idx)
    if isinstance(provider, BatchSpanKeyValues):
        return batch_attention(provider, module.layer_idx, query, key, value, float(scaling)), None
    if not isinstance(provider, SpanKeyValues):
        raise RuntimeError(
            f"span attention of layer {module.layer_idx} without its SpanKeyValues update: the graphs "
            f"of a model with span attention need GraphShapes(span=True)"
        )
    k_cache, v_cache = provider.cache
    visible = provider.visible(attention_mask, GRAPH_MASKED)
    return torch_op()(
        query, k_cache, v_cache, module.layer_idx, provider.start, key, value, visible, float(scaling), provider.stored
    ), None


def batch_attention(provider: BatchSpanKeyValues, layer: int, query, key, value, scale: float):
    """Each sequence's rows through the kernel over its own cache, start and mask, concatenated along the rows:
    row b * T + t is row t of that sequence's own call."""
    op, rows, outputs = torch_op(), provider.rows, []
    for index, ((k_cache, v_cache), start, visible) in enumerate(zip(provider.caches, provider.starts, provider.masks)):
        span = slice(index * rows, (index + 1) * rows)
        own = (query[:, :, span], key[:, :, span], value[:, :, span])
        outputs.append(op(own[0], k_cache, v_cache, layer, start, own[1], own[2], visible, scale, provider.stored))
    return torch.cat(outputs, dim=1)


def span_model(model: SpeculativeStreamingLM) -> SpeculativeStreamingLM:
    """A copy of `model` whose attention is span_attention (its graphs need GraphShapes.span)."""
    hf.register_attention(SPAN_ATTENTION, span_attention)
    ready = copy.deepcopy(model)
    hf.set_attention(ready.model, SPAN_ATTENTION)
    return ready
