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

    `active`: the provider and layer of the attention call under way, for a provider that its attention
    function reads (`announced`): HF attention calls update() and then its attention function, which gets
    the module but not the provider. The function takes it (`take_active`, for the module's layer). A new
    provider and every update clear what an attention that does not read it (Core ML's, eager) left.
    """

    active: tuple[KeyValues, int] | None = None
    announced = False

    def __init__(self, main_len: int):
        self.main_len = main_len
        self.value_angles: torch.Tensor | None = None
        KeyValues.active = None

    @staticmethod
    def take_active(layer: int | None) -> KeyValues | None:
        """The provider whose update() announced `layer` just before this attention call, else None."""
        active, KeyValues.active = KeyValues.active, None
        return active[0] if active is not None and active[1] == layer else None

    def _store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this call's main-token K/V [B, kv_heads, main_len, d]; return past + them."""
        raise NotImplementedError

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        KeyValues.active = (self, layer_idx) if self.announced else None
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

    past: per layer (keys, values) [B, kv_heads, P, d], or None for no cache; attention sees past + this
    call's rows appended after it ([P + T] keys).
    """

    def __init__(self, num_layers: int, main_len: int, past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__(main_len)
        self.past = past
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def _store(self, layer, keys, values):
        self.new[layer] = (keys, values)
        if self.past is None:
            return keys, values
        past_keys, past_values = self.past[layer]
        return torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2)


class ScratchKeyValues(KeyValues):
    """K/V written into the free slots of a preallocated cache (eager only: the graphs' "scratch" layout):
    this call's main rows go to slots start.. of cache (keys, values [L, kv, C, d]) in place, and attention
    reads a view of slots [0, start + rows): no copy of the cache. The host keeps the rows it accepts and
    overwrites the rest on the next call."""

    def __init__(self, num_layers: int, main_len: int, cache: tuple[torch.Tensor, torch.Tensor], start: int):
        super().__init__(main_len)
        self.cache, self.start = cache, start
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def _store(self, layer, keys, values):
        end = self.start + self.main_len
        if end > self.cache[0].shape[2]:
            raise ValueError(f"{end} cache slots needed, {self.cache[0].shape[2]} allocated")
        self.new[layer] = (keys, values)
        for cache, rows in zip(self.cache, (keys, values)):
            cache[layer : layer + 1, :, self.start : end] = rows
        return self.cache[0][layer : layer + 1, :, :end], self.cache[1][layer : layer + 1, :, :end]


class SpanKeyValues(KeyValues):
    """K/V for an attention kernel that reads the cache in place over its used span (span_attention in
    export/span_attention.py): attention gets only this call's rows as keys (after `prefix` rows per layer,
    e.g. the step rows that deferred streams see), and reads the whole cache (keys, values [L, kv, C, d]: a
    layer's slice would be a copy in the exported graph) and `start` (it attends slots [0, start)) from
    here. Nothing is concatenated with the cache. The attention reads it as KeyValues.active (announced).
    store: the kernel also writes this call's main rows into slots start.. of the cache (`stored` rows a layer)."""

    announced = True

    def __init__(
        self,
        num_layers: int,
        main_len: int,
        cache: tuple[torch.Tensor, torch.Tensor],
        start: torch.Tensor,
        prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        store: bool = False,
    ):
        super().__init__(main_len)
        if store and prefix is not None:
            raise ValueError("a call that stores its rows has none before them: the stored rows come first")
        self.cache, self.start, self.prefix = cache, start, prefix
        self.stored = main_len if store else 0
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self._visible: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def visible(self, mask: torch.Tensor, masked: float) -> torch.Tensor:
        """[rows, X] 0/1 of an additive mask [1, 1, rows, X], computed once per mask (the layers share one)."""
        if id(mask) not in self._visible:  # the mask is kept beside its id so the id cannot be reused
            self._visible[id(mask)] = (mask, (mask[0, 0] > masked / 2).to(mask.dtype))
        return self._visible[id(mask)][1]

    def _store(self, layer, keys, values):
        self.new[layer] = (keys, values)
        if self.prefix is None:
            return keys, values
        prefix_keys, prefix_values = self.prefix[layer]
        return torch.cat([prefix_keys, keys], dim=2), torch.cat([prefix_values, values], dim=2)


class BatchSpanKeyValues(KeyValues):
    """K/V of a batched step (export/batch_pass.py) for span_attention: the call's rows are `sequences` sequences of
    `rows` rows each, every sequence with its own cache (keys, values [L, kv, C, d]), `start` ([1]: it attends
    slots [0, start)) and `visible` ([rows, rows] 0/1 among its own rows). The attention runs the kernel once per
    sequence on its rows, which it also writes into that cache at slots start.. (stored); no row sees another
    sequence's."""

    announced = True

    def __init__(
        self,
        num_layers: int,
        rows: int,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        starts: Sequence[torch.Tensor],
        visible: Sequence[torch.Tensor],
    ):
        super().__init__(rows * len(caches))
        if not len(caches) == len(starts) == len(visible):
            raise ValueError(f"{len(caches)} caches, {len(starts)} starts, {len(visible)} masks: give one per sequence")
        self.rows, self.caches, self.starts, self.masks = rows, list(caches), list(starts), list(visible)
        self.stored = rows
        self.new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def _store(self, layer, keys, values):
        self.new[layer] = (keys, values)
        return keys, values
