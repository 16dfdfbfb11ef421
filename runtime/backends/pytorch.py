"""PyTorch backend (CPU and CUDA): eager SpeculativeStreamingLM with a preallocated KV cache.
Its outputs reach the decode loop as numpy arrays, as every backend's do (runtime/backends/base.py)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from streamfuse import seams
from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.masks import additive
from streamfuse.adapters.medusa import MedusaHeads
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.runtime.backends.base import (
    HEAD_LOGITS,
    HIDDEN,
    STREAM_STATES,
    PruneConfig,
    StepOutput,
    process_peak_rss_bytes,
)
from streamfuse.runtime.backends.packed_linear import PackedLinear, resolve_kernels
from streamfuse.runtime.kv_cache import KVCache
from streamfuse.runtime.options import STREAM_SCHEDULES
from streamfuse.runtime.tree import TreeSpec


class TorchBackend:
    """stream_schedule "fused": streams ride along every tree node in the one forward pass (the
    paper's schedule; best where a pass is memory-bound). "deferred": the pass verifies only, and
    after the commit the streams of the last accepted node alone run through the N_s MSA layers
    (same outputs, far less compute; best on CPUs). Call stream_logits only after commit.
    kernels "packed" swaps the linear layers for oneDNN-prepacked ones (packed_linear.py), so a
    tree step's few rows cost little more than one; "auto" packs wherever that is possible. The
    swap happens in place on `model`: pass kernels="eager" for a model that is exported later."""

    name = "torch"

    def __init__(self, model: SpeculativeStreamingLM, device: str = "cpu", stream_schedule: str = "fused",
                 kernels: str = "auto"):
        if stream_schedule not in STREAM_SCHEDULES:
            raise ValueError(f"stream_schedule must be one of {STREAM_SCHEDULES}, got {stream_schedule!r}")
        self.stream_schedule = stream_schedule
        self.model = model.to(device).eval().requires_grad_(False)  # inference only: no autograd state
        self.device = device
        self.num_streams = model.num_streams
        self.vocab_size = model.parts.vocab_size
        self.max_positions = model.parts.max_positions
        self.dtype = next(model.parameters()).dtype
        self.kernels = resolve_kernels(kernels, device, self.dtype)
        if self.kernels == "packed":
            self.model.replace_linears(PackedLinear)
        self.cache: KVCache | None = None
        self._tree_masks: dict[tuple, torch.Tensor] = {}  # by tree shape (its paths)
        self.heads: MedusaHeads | None = None

    def attach_heads(self, heads: MedusaHeads) -> None:
        """Medusa heads on the target's last hidden state: every step's output then ranks their drafts
        too (StepOutput.extras[HEAD_LOGITS]), computed only for the node a drafter asks for."""
        self.heads = heads.to(self.device, self.dtype).eval().requires_grad_(False)

    @classmethod
    def with_random_weights(cls, base_model: str, streams: StreamConfig, device: str = "cpu",
                            dtype: torch.dtype = torch.float32, stream_schedule: str = "fused",
                            kernels: str = "auto") -> "TorchBackend":
        """Same architecture as `base_model` (a config is enough), random weights: step latency
        depends on shapes only, so it can be measured where the weights cannot travel."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from streamfuse.adapters.base_model import resolve_base_model

        config = AutoConfig.from_pretrained(resolve_base_model(base_model))
        seams.set_attention_implementation(config, "sdpa")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # The streams' own parameters start in fp32: the whole model runs in `dtype`.
        return cls(SpeculativeStreamingLM(model, streams).to(dtype), device, stream_schedule, kernels)

    def step_rows(self, tree: TreeSpec | None) -> int:
        return tree.num_nodes if tree is not None else 1

    def reset(self, capacity: int) -> None:
        parts = self.model.parts
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = KVCache(parts.num_layers, parts.num_kv_heads, parts.head_dim, capacity, self.dtype, self.device)
        self.cache.reset()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], with_streams: bool) -> StepOutput:
        count = len(token_ids)
        ids = torch.tensor([list(token_ids)], device=self.device)
        positions = torch.arange(count, device=self.device)[None]
        mask = self._mask(torch.ones(count, count, dtype=torch.bool, device=self.device).tril())
        fused = with_streams and self.stream_schedule == "fused"
        anchors = torch.tensor([[count - 1]], device=self.device) if fused else None
        lower = self.model.forward_lower(ids, positions, mask, self.cache.writer(count))
        out = self.model.forward_upper(lower, anchors)
        self.cache.commit(range(count))
        states = self._stream_states(out, lower.hidden[:, -1:], [0]) if with_streams else None
        return StepOutput(host(self.model.logits(out.hidden[0, -1:])), self._stream_logits(states),
                          extras=self._extras(out.hidden[0, -1:], states))

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], tree: TreeSpec | None, with_streams: bool,
             prune: PruneConfig | None = None, greedy: bool = False) -> StepOutput:
        count = len(tokens)
        depths = torch.tensor(tree.depths if tree else [0], device=self.device)
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = (self.cache.length + depths)[None]
        visible = self._tree_visibility(tree) if tree else torch.ones(1, 1, dtype=torch.bool, device=self.device)
        lower = self.model.forward_lower(ids, positions, self._mask(visible), self.cache.writer(count),
                                         with_pruning=prune is not None)
        kept = self._prune(lower.pruning_hidden[0], tokens, tree, prune) if prune is not None else None
        nodes = [n for n in range(count) if kept is None or kept[n]]
        fused = with_streams and self.stream_schedule == "fused"
        out = self.model.forward_upper(lower, torch.tensor([nodes], device=self.device) if fused else None)
        states = self._stream_states(out, lower.hidden, nodes) if with_streams else None
        return StepOutput(host(self.model.logits(out.hidden[0])), self._stream_logits(states), kept,
                          extras=self._extras(out.hidden[0], states))

    def commit(self, nodes: Sequence[int]) -> None:
        self.cache.commit(list(nodes))

    def rollback(self, length: int) -> None:
        self.cache.truncate(length)

    def peak_memory_bytes(self) -> int | None:
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated())
        return process_peak_rss_bytes()

    # --- helpers ----------------------------------------------------------------------------
    def _stream_states(self, out, lower_hidden: torch.Tensor, nodes: list[int]):
        """node -> [gamma, H] final-normed stream states, computed on demand for the last accepted node
        only, once. lower_hidden [1, T, H] holds each node's main state at layer N - N_s; nodes are the
        ones that got fused streams, in order."""
        if self.stream_schedule == "fused":
            slot = {node: index for index, node in enumerate(nodes)}
            return lambda node: out.stream_hidden[0, slot[node]]
        return functools.lru_cache(maxsize=1)(lambda node: self._deferred_streams(lower_hidden[:, node : node + 1]))

    def _stream_logits(self, states):
        """node -> [gamma, V] stream logits (only gamma rows ever pay the LM head); None without streams."""
        return None if states is None else lambda node: host(self._head(states(node)))

    def _extras(self, hidden: torch.Tensor, states) -> dict:
        """StepOutput.extras from the final-normed states [T, H] and the stream states' source; the Medusa
        heads' logits on a node's state where heads are attached."""
        extras = {HIDDEN: host(hidden)}
        if states is not None:
            extras[STREAM_STATES] = on_host(states)
        if self.heads is not None:
            extras[HEAD_LOGITS] = lambda node: host(self._head(self.heads(hidden[node])))
        return extras

    @torch.inference_mode()
    def _deferred_streams(self, anchor_hidden: torch.Tensor) -> torch.Tensor:
        """Streams of the node just committed last: its ancestors and itself are the cache now."""
        past = self.cache.length
        position = torch.tensor([[past - 1]], device=self.device)
        mask = torch.zeros(1, 1, 1, past, dtype=self.dtype, device=self.device)
        return self.model.forward_streams(anchor_hidden, position, mask, self.cache.writer(0))[0, 0]

    @torch.inference_mode()
    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden).float()

    def _tree_visibility(self, tree: TreeSpec) -> torch.Tensor:
        key = tree.paths  # the shape (hashable as it is: no digest on every step)
        if key not in self._tree_masks:
            self._tree_masks[key] = torch.from_numpy(tree.ancestor_mask).to(self.device)
        return self._tree_masks[key]

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """[T, T] visibility among the new tokens -> additive [1, 1, T, past + T]; past all visible."""
        count, past = visible.shape[0], self.cache.length
        seen = torch.cat([visible.new_ones(count, past), visible], dim=1)
        return additive(seen, self.dtype)[None, None]

    def _prune(self, early_hidden: torch.Tensor, tokens: Sequence[int], tree: TreeSpec, prune: PruneConfig) -> list[bool]:
        """Transition probability parent -> child from the early-exit head at the parent."""
        probs = torch.softmax(self.model.logits(early_hidden).float(), dim=-1)
        parents = torch.tensor(tree.parents[1:], device=probs.device)
        child_tokens = torch.tensor(list(tokens[1:]), device=probs.device)
        transition = [1.0] + probs[parents, child_tokens].tolist()
        return keep_nodes(tree, transition, prune)


def host(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as the host's float32 numpy array (a view on CPU when it is float32 already)."""
    return tensor.detach().float().cpu().numpy()


def on_host(source):
    """node -> tensor, as node -> numpy array (None stays None)."""
    return None if source is None else lambda node: host(source(node))


def keep_nodes(tree: TreeSpec, transition: Sequence[float], prune: PruneConfig) -> list[bool]:
    """Nodes that survive pruning; always ancestor-closed, the root always kept."""
    score = [1.0] * tree.num_nodes
    kept = [True] * tree.num_nodes
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        score[node] = score[parent] * transition[node]
        below = prune.threshold is not None and transition[node] < prune.threshold
        kept[node] = kept[parent] and not below
    if prune.budget is not None:
        # Path probability only falls along a path, so the best-scoring nodes form a closed subtree
        # (ties broken towards shallower, earlier nodes, which are ancestors).
        ranked = sorted((n for n in range(1, tree.num_nodes) if kept[n]), key=lambda n: (-score[n], n))
        allowed = set(ranked[: prune.budget])
        kept = [n == 0 or (kept[n] and n in allowed) for n in range(tree.num_nodes)]
        for node in range(1, tree.num_nodes):
            kept[node] = kept[node] and kept[tree.parents[node]]
    return kept
