"""XNNPACK-friendly modules compute what the Hugging Face ones do, and keep a method in few partitions."""

import collections
import importlib.util

import pytest
import torch
from conftest import make_tiny_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm, eager_attention_forward

from streamfuse.adapters import hf
from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export import graph
from streamfuse.export.xnnpack_graph import (PooledRMSNorm, grouped_attention, ordered_attention, views_for_xnnpack,
                                             xnnpack_model)

SHAPES = graph.GraphShapes(capacity=48, prefill_chunk=8, buckets=(4,))


def tiny_model():
    base = make_tiny_llama(layers=4, hidden=64)
    return SpeculativeStreamingLM(base, StreamConfig(num_streams=3, msa_layers=2)).eval().requires_grad_(False)


@pytest.mark.parametrize("shape", [(1, 5, 64), (2, 3, 4, 64)])
def test_pooled_rms_norm_is_rms_norm(shape):
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    hidden = torch.randn(shape) * 3
    torch.testing.assert_close(PooledRMSNorm(norm)(hidden), norm(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", [grouped_attention, ordered_attention])
def test_graph_attention_is_eager_attention(attention):
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    query, key, value = torch.randn(1, 6, 4, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    mask = torch.zeros(1, 1, 4, 9).masked_fill(torch.rand(1, 1, 4, 9) < 0.4, GRAPH_MASKED)
    mask[..., 0] = 0.0  # every row sees something
    expected, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    actual, _ = attention(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_xnnpack_model_gives_the_graphs_outputs_and_leaves_the_model_alone():
    model = tiny_model()
    ready = xnnpack_model(model)
    inputs = graph.example_inputs(model, SHAPES)
    inputs["decode"] = (torch.tensor([[5]]), torch.tensor([3]), torch.randn(4, 2, 48, 16), torch.randn(4, 2, 48, 16))
    for name in ("prefill", "decode", "step_4", "streams"):
        expected = graph.graph_modules(model, SHAPES)[name](*inputs[name])
        actual = graph.graph_modules(ready, SHAPES)[name](*inputs[name])
        for got, want in zip(actual, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, PooledRMSNorm) for m in model.modules())
    assert sum(isinstance(m, PooledRMSNorm) for m in ready.modules()) == 2 * 4 + 1
    assert hf.unwrap_peft(model.model).config._attn_implementation == "sdpa"


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed (extra: export)")
def test_a_decode_method_lowers_to_xnnpack_in_few_partitions():
    from executorch.exir import to_edge_transform_and_lower

    from streamfuse.export.to_executorch import partitioner

    model = xnnpack_model(tiny_model())
    module, inputs = graph.graph_modules(model, SHAPES)["decode"], graph.example_inputs(model, SHAPES)["decode"]
    program = views_for_xnnpack(torch.export.export(module, inputs, strict=False))
    lowered = to_edge_transform_and_lower({"decode": program}, partitioner=[partitioner("xnnpack")])
    ops = collections.Counter(str(node.target) for node in lowered.exported_program("decode").graph.nodes
                              if node.op == "call_function")
    # Unpatched, every layer split in ~6 pieces around RMSNorm's mean, SDPA and unsqueezes (28 here).
    assert ops["executorch_call_delegate"] <= 3
    assert not [op for op in ops if any(word in op for word in ("mean", "softmax", "bmm", "alias"))]
    assert sum(count for op, count in ops.items() if "unsqueeze" in op) <= 1  # the cache length's, once


class StepAttention(torch.nn.Module):
    """One attention call as the graphs make it: T new rows appended after the C cache rows."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, query, past_keys, past_values, keys, values, mask):
        all_keys, all_values = torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2)
        return self.attention(None, query, all_keys, all_values, mask, 0.25)[0]


def chain_attention_cases(count: int = 4, cache_len: int = 21, capacity: int = 40, seed: int = 0):
    """(step inputs, [decode inputs of node j]): node j of a chain step sees the cache and nodes 0..j;
    plain decoding of the same token finds nodes 0..j-1 in the cache at slots cache_len.. and itself appended."""
    torch.manual_seed(seed)
    heads, kv_heads, size = 6, 2, 16
    past_keys, past_values = torch.randn(1, kv_heads, capacity, size), torch.randn(1, kv_heads, capacity, size)
    keys, values, query = torch.randn(1, kv_heads, count, size), torch.randn(1, kv_heads, count, size), \
        torch.randn(1, heads, count, size) * 3
    mask = torch.full((1, 1, count, capacity + count), GRAPH_MASKED)
    mask[..., :cache_len] = 0.0
    for node in range(count):
        mask[..., node, capacity : capacity + node + 1] = 0.0
    plain = []
    for node in range(count):
        cache_keys, cache_values = past_keys.clone(), past_values.clone()
        cache_keys[:, :, cache_len : cache_len + node] = keys[:, :, :node]
        cache_values[:, :, cache_len : cache_len + node] = values[:, :, :node]
        row_mask = torch.full((1, 1, 1, capacity + 1), GRAPH_MASKED)
        row_mask[..., : cache_len + node] = 0.0
        row_mask[..., capacity] = 0.0
        plain.append(tuple(t.contiguous() for t in (query[:, :, node : node + 1], cache_keys, cache_values,
                                                    keys[:, :, node : node + 1], values[:, :, node : node + 1], row_mask)))
    return (query, past_keys, past_values, keys, values, mask), plain


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed (extra: export)")
def test_xnnpack_ordered_attention_gives_a_chain_node_plain_decodings_bits():
    """On XNNPACK, node j of a step equals plain decoding of its token bit for bit (1 and 2 threads),
    although its ancestors sit after the cache there and inside it in plain decoding; softmax's
    lane-wise sums (grouped_attention) do not, on these inputs."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from streamfuse.export.to_executorch import partitioner
    from streamfuse.runtime.backends.sessions import set_executorch_threads

    step, plain = chain_attention_cases()
    differs = {}
    for attention in (ordered_attention, grouped_attention):
        module = StepAttention(attention)
        programs = {"step": torch.export.export(module, step, strict=False),
                    "decode": torch.export.export(module, plain[0], strict=False)}
        lowered = to_edge_transform_and_lower(programs, partitioner=[partitioner("xnnpack")])
        for name in programs:
            ops = {str(n.target) for n in lowered.exported_program(name).graph.nodes if n.op == "call_function"}
            assert not [op for op in ops if any(w in op for w in ("bmm", "exp", "softmax", "amax", "div"))], ops
        buffer = lowered.to_executorch().buffer
        for threads in (1, 2):
            set_executorch_threads(threads)  # then load: a program keeps the pool it was loaded with
            program = Runtime.get().load_program(buffer)
            step_method, decode = program.load_method("step"), program.load_method("decode")
            rows = step_method.execute(list(step))[0].clone()
            alone = torch.cat([decode.execute(list(case))[0].clone() for case in plain], dim=1)
            differs[attention.__name__, threads] = not torch.equal(rows, alone)
            torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-6)
    assert differs == {("ordered_attention", 1): False, ("ordered_attention", 2): False,
                       ("grouped_attention", 1): True, ("grouped_attention", 2): True}
