"""Every attention mask, in one convention: additive (0 where a query may see a key, a large negative
number where it may not), built from boolean visibility; the model's layers take [B, 1, queries, keys].

The torch paths fill with the dtype's most negative number (masked_value); the exported graphs fill
with GRAPH_MASKED, which survives Core ML's fp16 (finfo(float32).min becomes -inf there, and a row
of -inf is NaN after softmax).
"""

from __future__ import annotations

import torch

# Finite in fp16 (Core ML computes in fp16, where 0 * -inf would be NaN) and still far enough below
# any real score that softmax gives it exactly 0 in fp32.
GRAPH_MASKED = -30000.0


def additive(visible: torch.Tensor, dtype: torch.dtype = torch.float32, fill: float | None = None) -> torch.Tensor:
    """0 where `visible`, `fill` (default: masked_value(dtype)) elsewhere; same shape."""
    value = masked_value(dtype) if fill is None else fill
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, value)


def masked_value(dtype: torch.dtype) -> float:
    """Additive mask value: the dtype's most negative number (-inf would turn empty rows into NaN)."""
    return torch.finfo(dtype).min


def stream_block(num_anchors: int, num_streams: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """[A*g, A*g] additive mask among stream tokens, laid out anchor-major: 0 where both tokens
    belong to the same anchor and the key's stream index <= the query's, else masked."""
    anchor = torch.arange(num_anchors, device=device).repeat_interleave(num_streams)
    stream = torch.arange(num_streams, device=device).repeat(num_anchors)
    # logical_and, not `&`: Core ML's converter knows the former only.
    allowed = torch.logical_and(anchor[:, None] == anchor[None, :], stream[None, :] <= stream[:, None])
    block = torch.full(allowed.shape, masked_value(dtype), dtype=dtype, device=device)
    return block.masked_fill(allowed, 0.0)


def multi_stream_mask(main_mask: torch.Tensor, anchors: torch.Tensor, num_streams: int) -> torch.Tensor:
    """Extend the main-stream mask to main + stream tokens.

    main_mask: [B, 1, T, K] additive (K = past + T key columns).
    anchors:   [B, A] indices into the T main tokens where streams are inserted.
    returns:   [B, 1, T + A*g, K + A*g].
    """
    batch, _, tokens, keys = main_mask.shape
    num_anchors = anchors.shape[1]
    width = num_anchors * num_streams
    fill = masked_value(main_mask.dtype)
    main_rows = torch.cat([main_mask, main_mask.new_full((batch, 1, tokens, width), fill)], dim=-1)
    index = anchors[:, None, :, None].expand(batch, 1, num_anchors, keys)
    anchor_rows = torch.gather(main_mask, 2, index).repeat_interleave(num_streams, dim=2)
    block = stream_block(num_anchors, num_streams, main_mask.dtype, main_mask.device)
    stream_rows = torch.cat([anchor_rows, block.expand(batch, 1, width, width)], dim=-1)
    return torch.cat([main_rows, stream_rows], dim=2)


def causal_mask(padding: torch.Tensor, dtype: torch.dtype = torch.float32, past: int = 0) -> torch.Tensor:
    """Additive causal mask [B, 1, T, past + T] from a [B, T] 1/0 padding mask (1 = real token).

    Padded keys are masked; padded query rows still see earlier tokens so they never go NaN.
    """
    batch, tokens = padding.shape
    keys = past + tokens
    query_pos = torch.arange(tokens, device=padding.device)[:, None] + past
    allowed = torch.arange(keys, device=padding.device)[None, :] <= query_pos  # [T, K]
    key_valid = torch.cat([padding.new_ones(batch, past), padding], dim=1).bool()  # [B, K]
    allowed = allowed[None] & key_valid[:, None, :]
    return additive(allowed[:, None], dtype)
