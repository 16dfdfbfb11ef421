"""Multi-stream attention (paper eq. 1-2) as a layout, a mask, and a key/value provider.

An MSA layer is the base decoder layer run over [main tokens ; stream tokens] with a mask:
- main row t sees exactly what the base model lets it see (past cache + its own mask row), and
  never a stream column, so the main stream computes exactly the base model's function;
- stream (a, j), inserted at main token anchors[a], sees what that main token sees, plus the
  streams (a, i <= j) of the same anchor (eq. 2).
Stream keys/values exist only inside the call: `StepKeyValues` hands main-token K/V out for
caching and drops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KeyValues:
    """Key/value provider for one forward pass, passed to HF attention as `past_key_values`.

    HF attention hands over the keys/values of all rows of the call: the first `main_len` rows
    are main-stream tokens, the rest (MSA layers only) are stream tokens. Subclasses decide where
    main-token K/V live (`_store`); stream K/V never leave the call. value_angles ([S] radians,
    one per stream token, set by the model for value-rotation streams) rotates stream values
    (appendix B, eq. 7).
    """

    def __init__(self, main_len: int):
        self.main_len = main_len
        self.value_angles: torch.Tensor | None = None

    def _store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this call's main-token K/V [B, kv_heads, main_len, d]; return past + them."""
        raise NotImplementedError

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        main = self.main_len
        all_keys, all_values = self._store(layer_idx, keys[:, :, :main], values[:, :, :main])
        if keys.shape[2] == main:
            return all_keys, all_values
        stream_values = values[:, :, main:]
        if self.value_angles is not None:
            stream_values = self._rotate(stream_values)
        return torch.cat([all_keys, keys[:, :, main:]], dim=2), torch.cat([all_values, stream_values], dim=2)

    def _rotate(self, values: torch.Tensor) -> torch.Tensor:
        """Rotate each stream token's value pairs by its angle: V e^{i eps n} (appendix B)."""
        angles = self.value_angles.to(values.dtype)[:, None]  # [S, 1]
        return values * angles.cos() + rotate_half(values) * angles.sin()


class StepKeyValues(KeyValues):
    """Functional K/V: past comes in as tensors (read only), this call's main K/V go to `new`.

    past: per layer (keys, values) [B, kv_heads, P, d], or None for no cache.
    write_at: None: attention sees past + this call's rows appended after it ([P + T] keys);
    a [1] cache length n: this call's rows take slots n.. of a copy of the past ([P] keys), so a
    token at position p sits at slot p whether it came from this call or an earlier one (the
    graphs' mask for this layout: in_place_slots).
    """

    def __init__(self, num_layers: int, main_len: int, past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 write_at: torch.Tensor | None = None):
        super().__init__(main_len)
        self.past = past
        self.write_at = write_at
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def _store(self, layer, keys, values):
        self.new[layer] = (keys, values)
        if self.past is None:
            return keys, values
        past_keys, past_values = self.past[layer]
        if self.write_at is None:
            return torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2)
        # index_copy (ONNX ScatterND): only the T new rows are written, into a copy of the past
        slots = self.write_at + torch.arange(keys.shape[2], device=keys.device)
        return past_keys.index_copy(2, slots, keys), past_values.index_copy(2, slots, values)


def in_place_slots(start: torch.Tensor, capacity: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [start, start + count) of a capacity-row cache: (inside [C] bool, index [C] of the new
    row each slot takes, clamped where outside)."""
    offset = torch.arange(capacity, device=start.device) - start
    inside = torch.logical_and(offset >= 0, offset < count)
    return inside, offset.clamp(0, count - 1)
