"""SpeculativeStreamingLM: a Hugging Face causal LM with speculative streams fused in.

The forward pass is explicit: token ids, positions, an additive mask, past key/values and the
anchor tokens at which streams are inserted all come in as arguments; hidden states and the
new main-stream key/values come out. Nothing is stored on the module between calls.

    main tokens ─► layers [0, N-N_s) ─► (pruning head reads layer l) ─► insert streams at anchors
                ─► layers [N-N_s, N) over [main ; streams] with the multi-stream mask ─► norm
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from . import hf
from .config import StreamConfig
from .masks import multi_stream_mask, stream_block
from .msa import KeyValues, StepKeyValues
from .pruning import PruningHead
from .streams import StreamInit


@dataclass
class StreamingOutput:
    hidden: torch.Tensor  # [B, T, H] final-normed main-stream states
    stream_hidden: torch.Tensor | None  # [B, A, gamma, H] final-normed stream states at the anchors
    pruning_hidden: torch.Tensor | None  # [B, T, H] final-normed early-exit states of the pruning head
    key_values: KeyValues  # the provider used; StepKeyValues.new holds this call's main-token K/V

    @property
    def new_key_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer [B, kv_heads, T, d] K/V of this call's main tokens (StepKeyValues only)."""
        return self.key_values.new


@dataclass
class BottomState:
    """The main stream after layers [0, depth) that no trainable parameter touches: training
    computes it once per example and starts later passes from it (training/frozen_states.py)."""

    depth: int
    hidden: torch.Tensor  # [B, T, H]


@dataclass
class LowerState:
    """The main stream after layers [0, N - N_s), ready for forward_upper."""

    hidden: torch.Tensor  # [B, T, H]
    position_ids: torch.Tensor
    mask: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    key_values: KeyValues
    pruning_hidden: torch.Tensor | None  # [B, T, H] final-normed early-exit states


class SpeculativeStreamingLM(nn.Module):
    """Wraps a (possibly peft-wrapped) HF causal LM; adds streams and the pruning head."""

    def __init__(self, model: nn.Module, config: StreamConfig):
        super().__init__()
        self.model = model
        self.config = config
        self.parts = hf.decoder_parts(model)
        config.validate(self.parts.num_layers)
        self.stream_init = StreamInit(config, self.parts.hidden_size)
        self.pruning_head = PruningHead(self.parts.hidden_size, config.pruning_rank)
        self.split = config.first_msa_layer(self.parts.num_layers)
        self.pruning_layer = config.pruning_layer_index(self.parts.num_layers)
        self.rotation_step = (
            config.value_rotation_step(self.parts.max_positions) if config.stream_init == "value_rotation" else None
        )
        self.register_buffer("vocab_ids", None)  # keep_vocab's token ids; None: the head covers the vocabulary
        self.vocab_head: nn.Module | None = None

    @property
    def num_streams(self) -> int:
        return self.config.num_streams

    def grow_stream_init(self, init_rank: int, per_stream: bool) -> None:
        """Give trained streams a (new) f_eta of this rank, keeping their identifier embeddings.
        f_eta starts as the identity, so the model computes exactly what it did before."""
        if self.config.stream_init != "embedding" or self.config.init_rank:
            raise ValueError("only embedding streams without an f_eta can grow one")
        config = replace(self.config, init_rank=init_rank, init_per_stream=per_stream)
        config.validate(self.parts.num_layers)
        grown = StreamInit(config, self.parts.hidden_size).to(self.stream_init.identifiers.device)
        with torch.no_grad():
            grown.identifiers.copy_(self.stream_init.identifiers)
        self.config, self.stream_init = config, grown

    def extra_parameters(self) -> dict[str, int]:
        """Parameters Speculative Streaming adds on top of the base model and its LoRA."""
        streams = sum(p.numel() for p in self.stream_init.parameters())
        pruning = sum(p.numel() for p in self.pruning_head.parameters())
        return {"streams": streams, "pruning_head": pruning, "total": streams + pruning}

    def replace_linears(self, convert: Callable[[nn.Linear], nn.Module]) -> int:
        """swap_linears over the base model, streams and pruning head; parts are re-read so the
        LM head is the new module too."""
        return self.replace_modules(lambda module: isinstance(module, nn.Linear), convert)

    def replace_modules(self, match: Callable[[nn.Module], bool], convert: Callable[[nn.Module], nn.Module]) -> int:
        """swap_modules over the whole model, then re-read parts (the final norm, the LM head)."""
        swapped = swap_modules(self, match, convert)
        self.parts = hf.decoder_parts(self.model)
        return swapped

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shared LM head: [..., H] final-normed states -> [..., V] (after keep_vocab: [..., D], the kept rows)."""
        return self.parts.lm_head(hidden) if self.vocab_head is None else self.vocab_head(hidden)

    def keep_vocab(self, ids: torch.Tensor) -> None:
        """Restrict the LM head to the rows of `ids` (ascending token ids): a draft model's pruned vocabulary
        (FR-Spec). Its logits cover those D tokens only, so a call reads D rows of the head instead of V; the
        embedding stays whole. Call before any module swap: the rows come from the float head."""
        weight = getattr(self.parts.lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError("keep_vocab needs the float LM head: call it before the head is quantized or packed")
        ids, rows = kept_rows(weight, ids)
        head = nn.Linear(weight.shape[1], len(ids), bias=False).to(weight.device, weight.dtype)
        head.weight = nn.Parameter(rows, requires_grad=False)
        self.vocab_ids, self.vocab_head = ids, head

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The token ids of logits columns (an argmax, a top-k): the columns themselves unless keep_vocab."""
        return columns if self.vocab_ids is None else self.vocab_ids[columns]

    def kept_vocab(self) -> np.ndarray | None:
        """keep_vocab's ids as a host array (the logits' columns), or None: the head covers the vocabulary."""
        return None if self.vocab_ids is None else self.vocab_ids.cpu().numpy()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        key_values: KeyValues | None = None,
        anchors: torch.Tensor | None = None,
        with_pruning: bool = False,
        bottom: BottomState | None = None,
    ) -> StreamingOutput:
        """input_ids, position_ids [B, T]; mask [B, 1, T, P + T] additive over (past, current);
        key_values: where past K/V come from and this call's go (default: no past, collect new);
        anchors [B, A] indices of main tokens that get gamma streams each (None: streams off);
        bottom: these tokens' states after the first layers, which are then skipped (no K/V)."""
        lower = self.forward_lower(input_ids, position_ids, mask, key_values, with_pruning, bottom)
        return self.forward_upper(lower, anchors)

    def forward_lower(
        self, input_ids, position_ids, mask, key_values=None, with_pruning=False, bottom: BottomState | None = None
    ) -> LowerState:
        """Main stream through layers [0, N - N_s) (from bottom.depth when given); the pruning
        head reads its layer on the way. Callers that prune a tree draft decide the anchors
        between this and forward_upper."""
        parts = self.parts
        start = 0 if bottom is None else bottom.depth
        if not 0 <= start <= (self.pruning_layer if with_pruning else self.split):
            raise ValueError(
                f"a bottom state after {start} layers is past the layer the pruning head or the "
                f"streams read ({self.pruning_layer} / {self.split})"
            )
        hidden = parts.embed(input_ids) if bottom is None else bottom.hidden
        rope = parts.rotary(hidden, position_ids)
        if key_values is None:
            key_values = StepKeyValues(parts.num_layers, input_ids.shape[1])
        pruning_hidden = None
        for index in range(start, self.split):
            if with_pruning and index == self.pruning_layer:
                pruning_hidden = self._early_exit(hidden)
            hidden = hf.call_layer(parts.layers[index], hidden, mask, rope, key_values)
        if with_pruning and self.pruning_layer == self.split:
            pruning_hidden = self._early_exit(hidden)
        return LowerState(hidden, position_ids, mask, rope, key_values, pruning_hidden)

    def forward_bottom(self, input_ids, position_ids, mask, depth: int) -> BottomState:
        """The main stream after layers [0, depth) alone (what `bottom` takes)."""
        if not 0 <= depth <= self.split:
            raise ValueError(f"bottom depth must be in [0, {self.split}], got {depth}")
        parts = self.parts
        hidden = parts.embed(input_ids)
        rope = parts.rotary(hidden, position_ids)
        key_values = StepKeyValues(parts.num_layers, input_ids.shape[1])
        return BottomState(depth, self._run_layers(range(depth), hidden, mask, rope, key_values))

    def frozen_depth(self) -> int:
        """How many bottom layers no trainable parameter reaches, up to what the pruning head or
        the streams read: their output for given tokens cannot change while training."""
        if any(p.requires_grad for p in self.parts.embed.parameters()):
            return 0
        limit = min(self.pruning_layer, self.split)
        for index in range(limit):
            if any(p.requires_grad for p in self.parts.layers[index].parameters()):
                return index
        return limit

    def forward_upper(self, lower: LowerState, anchors: torch.Tensor | None = None) -> StreamingOutput:
        """Layers [N - N_s, N): plain when anchors is None, else multi-stream over main + streams."""
        parts, top = self.parts, range(self.split, self.parts.num_layers)
        if anchors is None:
            hidden = self._run_layers(top, lower.hidden, lower.mask, lower.rope, lower.key_values)
            return StreamingOutput(parts.norm(hidden), None, lower.pruning_hidden, lower.key_values)
        main, streams = self._run_streams(lower.hidden, lower.position_ids, lower.mask, anchors, lower.key_values)
        return StreamingOutput(parts.norm(main), parts.norm(streams), lower.pruning_hidden, lower.key_values)

    def forward_streams(
        self,
        anchor_hidden: torch.Tensor,
        anchor_positions: torch.Tensor,
        past_mask: torch.Tensor,
        key_values: KeyValues,
    ) -> torch.Tensor:
        """Streams alone through the MSA layers, once their anchors' main K/V are in the past.

        Stream (a, j) attends to what anchor a sees plus streams (a, <= j) (eq. 2), so with a's
        ancestors and a itself already cached this equals the fused pass, at gamma tokens per
        anchor instead of gamma per tree node. anchor_hidden [B, A, H] are the anchors' main
        states at layer N - N_s; past_mask [B, 1, A, P] what each anchor sees of the past;
        key_values provides the past (main_len 0: nothing new is stored). -> [B, A, gamma, H]."""
        batch, num_anchors, size = anchor_hidden.shape
        gamma = self.num_streams
        streams, positions = self._stream_tokens(anchor_hidden, anchor_positions, key_values)
        block = stream_block(num_anchors, gamma, past_mask.dtype, past_mask.device).expand(batch, 1, -1, -1)
        mask = torch.cat([past_mask.repeat_interleave(gamma, dim=2), block], dim=-1)
        rope = self.parts.rotary(streams, positions)
        streams = self._run_layers(range(self.split, self.parts.num_layers), streams, mask, rope, key_values)
        return self.parts.norm(streams).reshape(batch, num_anchors, gamma, size)

    def _stream_tokens(self, anchor_hidden, anchor_positions, key_values):
        """Eq. 3 at the anchors -> (stream states [B, A*g, H], positions [B, A*g]), anchor-major.
        Stream j of the token at position p predicts token p + 1 + j, so it sits at position p + j.
        Value-rotation streams also get their angles on the key/value provider (eq. 7)."""
        batch, num_anchors, size = anchor_hidden.shape
        offsets = torch.arange(1, self.num_streams + 1, device=anchor_hidden.device)
        streams = self.stream_init(anchor_hidden).reshape(batch, num_anchors * self.num_streams, size)
        positions = (anchor_positions[:, :, None] + offsets).reshape(batch, -1)
        if self.rotation_step is not None:
            key_values.value_angles = (offsets * self.rotation_step).repeat(num_anchors).float()
        return streams, positions

    def _early_exit(self, hidden: torch.Tensor) -> torch.Tensor:
        # Detached: the pruning head learns from next-token loss without steering the main model.
        return self.parts.norm(self.pruning_head(hidden.detach()))

    def _run_layers(self, indices, hidden, mask, rope, key_values) -> torch.Tensor:
        for index in indices:
            hidden = hf.call_layer(self.parts.layers[index], hidden, mask, rope, key_values)
        return hidden

    def _run_streams(self, hidden, position_ids, mask, anchors, key_values):
        """Insert streams at the anchors, run the MSA layers, split main and stream states."""
        batch, tokens, size = hidden.shape
        gamma, num_anchors = self.num_streams, anchors.shape[1]
        anchor_hidden = torch.gather(hidden, 1, anchors[:, :, None].expand(batch, num_anchors, size))
        streams, stream_positions = self._stream_tokens(
            anchor_hidden, torch.gather(position_ids, 1, anchors), key_values
        )
        combined = torch.cat([hidden, streams], dim=1)
        rope = self.parts.rotary(combined, torch.cat([position_ids, stream_positions], dim=1))
        msa_mask = multi_stream_mask(mask, anchors, gamma)
        combined = self._run_layers(range(self.split, self.parts.num_layers), combined, msa_mask, rope, key_values)
        return combined[:, :tokens], combined[:, tokens:].reshape(batch, num_anchors, gamma, size)


def kept_rows(weight: torch.Tensor, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """A pruned head's token ids (checked: ascending, distinct, inside the vocabulary) and its rows of the LM head
    `weight` [V, H], detached copies."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=weight.device)
    if ids.dim() != 1 or not len(ids) or bool((ids[1:] <= ids[:-1]).any()) or ids[0] < 0 or ids[-1] >= len(weight):
        raise ValueError(
            f"the kept vocabulary must be ascending distinct ids in [0, {len(weight)}), got {len(ids)} ids that are not"
        )
    return ids, weight.detach()[ids].clone()


def swap_linears(root: nn.Module, convert: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every nn.Linear under `root` by convert(linear), in place (kernel variants by module
    swap, as ExecuTorch's examples do); returns how many were swapped."""
    return swap_modules(root, lambda module: isinstance(module, nn.Linear), convert)


def swap_modules(root: nn.Module, match: Callable[[nn.Module], bool], convert: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every module under `root` that `match`es by convert(module), in place."""
    swapped = 0
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if match(child):
                setattr(module, name, convert(child))
                swapped += 1
    return swapped
