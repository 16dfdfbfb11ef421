"""Static-shape graphs of a Speculative Streaming model: what ExecuTorch, ONNX and Core ML compile.

Every method is a pure function of explicit tensors; the host owns the KV cache:

    prefill(ids [1,P], cache_len [1], last [1], keys, values) -> logits [1,V], anchor [1,H], new_keys, new_values
    decode (ids [1,1], cache_len [1], keys, values)            -> logits [1,V], anchor [1,H], new_keys, new_values
    step   (ids [1,T], cache_len [1], keys, values)            -> logits [T,V], anchor [T,H], new_keys, new_values
    streams(anchor [1,H], cache_len [1], keys, values)         -> stream_logits [gamma,V]

keys/values [L, kv_heads, C, d] hold the committed cache: rows < cache_len are attended to,
the rest are masked out, so C (the capacity) is the only cache shape a graph ever sees.
new_keys/new_values [L, kv_heads, T, d] are this call's rows; the host copies the accepted
ones into its cache. The step graph's tree (visibility among its T nodes and their depths) is
a constant folded into the graph; prefill is a causal chunk of P tokens (a chain), decode a
chain of 1. anchor is each row's main-stream state at layer N - N_s: the streams method runs
the gamma streams of the last accepted node after its commit (the deferred schedule, whose
outputs equal the fused pass's; on CPUs it is the cheaper one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.msa import StepKeyValues
from streamfuse.runtime.backends.static_graph import INPUT_NAMES, OUTPUT_NAMES
from streamfuse.runtime.tree import TreeSpec

# The graphs' masked score: finite in fp16 (Core ML computes in fp16, where 0 * -inf would be NaN)
# and still far enough below any real score that softmax gives it exactly 0 in fp32.
MASKED = -30000.0


@dataclass(frozen=True)
class GraphShapes:
    """The static sizes every exported method is traced with."""

    capacity: int  # C: KV rows the graphs attend over (prompt + generated + one step)
    prefill_chunk: int  # P: prompt tokens per prefill call
    tree: TreeSpec  # the step graph's draft tree (T = tree.num_nodes)

    def __post_init__(self):
        if self.prefill_chunk < 1 or self.capacity < self.prefill_chunk + self.tree.num_nodes:
            raise ValueError(f"capacity {self.capacity} must hold at least one prefill chunk ({self.prefill_chunk}) "
                             f"plus one tree ({self.tree.num_nodes} nodes)")


def cache_mask(cache_len: torch.Tensor, capacity: int, rows: int) -> torch.Tensor:
    """[rows, C] additive: cache row c is visible iff c < cache_len."""
    hidden = torch.arange(capacity, device=cache_len.device)[None, :] >= cache_len[:, None]
    # A product, not torch.where with a scalar: Core ML's converter has no where.ScalarOther.
    return (hidden.to(torch.float32) * MASKED).expand(rows, capacity)


def split_cache(keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[L, kv, C, d] -> per layer ([1, kv, C, d], [1, kv, C, d]) as the model's K/V provider reads them."""
    return [(keys[layer][None], values[layer][None]) for layer in range(keys.shape[0])]


class MainPass(nn.Module):
    """prefill, decode or step: main stream over T new tokens with a constant visibility among them."""

    def __init__(self, model: SpeculativeStreamingLM, visibility: torch.Tensor, depths: list[int], capacity: int,
                 select_last: bool):
        super().__init__()
        self.model = model
        self.capacity = capacity
        self.select_last = select_last
        additive = torch.zeros(visibility.shape, dtype=torch.float32).masked_fill(~visibility, MASKED)
        self.register_buffer("tree_mask", additive, persistent=False)
        self.register_buffer("depths", torch.tensor(depths, dtype=torch.long), persistent=False)

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                last: torch.Tensor | None = None):
        count = ids.shape[1]
        mask = torch.cat([cache_mask(cache_len, self.capacity, count), self.tree_mask], dim=1)[None, None]
        positions = (cache_len + self.depths)[None]
        provider = StepKeyValues(keys.shape[0], count, split_cache(keys, values))
        lower = self.model.forward_lower(ids, positions, mask, provider)
        hidden = self.model.forward_upper(lower).hidden[0]
        anchor = lower.hidden[0]
        if self.select_last:  # prefill: only the last real prompt token matters to the host
            hidden, anchor = hidden.index_select(0, last), anchor.index_select(0, last)
        new_keys = torch.stack([k[0] for k, _ in provider.new])
        new_values = torch.stack([v[0] for _, v in provider.new])
        return self.model.logits(hidden), anchor, new_keys, new_values


class StreamsPass(nn.Module):
    """streams: the gamma streams of the node committed last, whose state at layer N - N_s is `anchor`."""

    def __init__(self, model: SpeculativeStreamingLM, capacity: int):
        super().__init__()
        self.model = model
        self.capacity = capacity

    def forward(self, anchor: torch.Tensor, cache_len: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        position = (cache_len - 1)[None]
        past_mask = cache_mask(cache_len, self.capacity, 1)[None, None]
        provider = StepKeyValues(keys.shape[0], 0, split_cache(keys, values))
        streams = self.model.forward_streams(anchor[None], position, past_mask, provider)
        return self.model.logits(streams[0, 0])


def chain_visibility(count: int) -> torch.Tensor:
    return torch.ones(count, count, dtype=torch.bool).tril()


def graph_modules(model: SpeculativeStreamingLM, shapes: GraphShapes) -> dict[str, nn.Module]:
    """method name -> module; the same model weights are shared by all four."""
    chunk, tree, capacity = shapes.prefill_chunk, shapes.tree, shapes.capacity
    return {
        "prefill": MainPass(model, chain_visibility(chunk), list(range(chunk)), capacity, select_last=True),
        "decode": MainPass(model, chain_visibility(1), [0], capacity, select_last=False),
        "step": MainPass(model, tree.ancestor_mask, tree.depths, capacity, select_last=False),
        "streams": StreamsPass(model, capacity),
    }


def example_inputs(model: SpeculativeStreamingLM, shapes: GraphShapes) -> dict[str, tuple[torch.Tensor, ...]]:
    """Inputs with the exported shapes and dtypes (values are arbitrary but valid)."""
    parts = model.parts
    shape = (parts.num_layers, parts.num_kv_heads, shapes.capacity, parts.head_dim)
    # Distinct tensors for keys and values: torch.export would fold one aliased input into both.
    keys, values = torch.zeros(shape), torch.zeros(shape)
    length = torch.tensor([shapes.prefill_chunk], dtype=torch.long)

    def ids(count: int) -> torch.Tensor:
        return torch.zeros(1, count, dtype=torch.long)

    return {
        "prefill": (ids(shapes.prefill_chunk), length, keys, values, torch.tensor([shapes.prefill_chunk - 1])),
        "decode": (ids(1), length, keys, values),
        "step": (ids(shapes.tree.num_nodes), length, keys, values),
        "streams": (torch.zeros(1, parts.hidden_size), length, keys, values),
    }


def signature(modules: dict[str, nn.Module], inputs: dict[str, tuple[torch.Tensor, ...]]) -> dict:
    """Per method: input and output names, shapes and dtypes (for the manifest and for checks)."""
    result = {}
    with torch.no_grad():
        for name, module in modules.items():
            outputs = module(*inputs[name])
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            result[name] = {
                "inputs": [_describe(n, t) for n, t in zip(INPUT_NAMES[name], inputs[name])],
                "outputs": [_describe(n, t) for n, t in zip(OUTPUT_NAMES[name], outputs)],
            }
    return result


def _describe(name: str, tensor: torch.Tensor) -> dict:
    return {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
