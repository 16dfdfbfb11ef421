"""XNNPACK-friendly modules compute what the Hugging Face ones do, and keep a method in few partitions."""

import collections
import importlib.util

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from streamfuse import seams
from streamfuse.adapters import hf
from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export import graph
from streamfuse.export.xnnpack_graph import PooledRMSNorm, views_for_xnnpack, xnnpack_model
from streamfuse.runtime.artifact.contract import output_names

from conftest import make_tiny_llama

SHAPES = graph.GraphShapes(capacity=48, prefill_chunk=8, buckets=(4,), span=True)
PLAIN = graph.GraphShapes(capacity=48, prefill_chunk=8, buckets=(4,))


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


def test_xnnpack_model_gives_the_graphs_outputs_and_leaves_the_model_alone():
    model = tiny_model()
    ready = xnnpack_model(model)
    inputs = graph.example_inputs(model, SHAPES)
    inputs["decode"] = (
        torch.tensor([[5]]),
        torch.tensor([3]),
        torch.randn(4, 2, 48, 16),
        torch.randn(4, 2, 48, 16),
        inputs["decode"][-1],
    )
    for name in ("prefill", "decode", "step_4", "greedy_step_4", "streams"):
        # HF's attention over the whole cache (it ignores the commit, which moves nothing here)
        expected = dict(zip(output_names(name, False), graph.graph_modules(model, PLAIN)[name](*inputs[name])))
        actual = graph.graph_modules(ready, SHAPES)[name](*(t.clone() for t in inputs[name]))
        for out_name, got in zip(output_names(name, True), actual, strict=True):
            torch.testing.assert_close(got, expected[out_name], rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, PooledRMSNorm) for m in model.modules())
    assert sum(isinstance(m, PooledRMSNorm) for m in ready.modules()) == 2 * 4 + 1
    assert seams.attention_implementation(hf.unwrap_peft(model.model).config) == "sdpa"
    assert seams.attention_implementation(hf.unwrap_peft(ready.model).config) == "streamfuse_span"


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed (extra: export)")
def test_a_decode_method_lowers_to_xnnpack_in_few_partitions():
    from executorch.exir import to_edge_transform_and_lower

    from streamfuse.export.to_executorch import partitioner

    model = xnnpack_model(tiny_model())
    module, inputs = graph.graph_modules(model, SHAPES)["decode"], graph.example_inputs(model, SHAPES)["decode"]
    program = views_for_xnnpack(torch.export.export(module, inputs, strict=False))
    lowered = to_edge_transform_and_lower({"decode": program}, partitioner=[partitioner("xnnpack")])
    ops = collections.Counter(
        str(node.target) for node in lowered.exported_program("decode").graph.nodes if node.op == "call_function"
    )
    # Unpatched, every layer splits in ~6 pieces around RMSNorm's mean, SDPA and unsqueezes (28 here); patched, the
    # only op outside XNNPACK in a layer is the span attention kernel: a partition before and after each.
    outside = {op.split(">")[0].split(": ")[-1] for op in ops if op.startswith("<EdgeOpOverload")}
    assert sum(count for op, count in ops.items() if "streamfuse.tree_attention" in op) == 4
    assert ops["executorch_call_delegate"] <= 4 + 3
    # no copy of the cache: the kernel reads the whole cache tensor (a layer's slice would be copied)
    assert not [op for op in outside if "slice" in op or "index" in op], outside
    assert not [op for op in ops if any(word in op for word in ("mean", "softmax", "bmm", "alias"))]
    assert sum(count for op, count in ops.items() if "unsqueeze" in op) <= 1  # the cache length's, once


def test_span_attention_outside_span_graphs_is_a_clear_error():
    model = xnnpack_model(tiny_model())
    inputs = graph.example_inputs(model, PLAIN)["decode"]
    with pytest.raises(RuntimeError, match="need GraphShapes\\(span=True\\)"):
        graph.graph_modules(model, PLAIN)["decode"](*inputs)


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="executorch not installed (extra: export)")
def test_lowering_without_the_ir_check_and_deep_provenance_writes_the_same_program(tmp_path):
    """export_pte skips the edge IR check and XNNPACK's passes that cannot act, and shares provenance records
    (~1/3 of lowering): same bytes."""
    from executorch.backends.xnnpack import _passes
    from executorch.exir import to_edge_transform_and_lower
    from torch.fx import traceback

    from streamfuse.export.to_executorch import export_pte, host_inputs, partitioner
    from streamfuse.seams import lowering_shares_weights

    model = xnnpack_model(tiny_model())
    modules = {name: graph.graph_modules(model, SHAPES)[name] for name in ("decode", "step_4")}
    inputs = graph.example_inputs(model, SHAPES)
    originals = traceback.NodeSource.__init__, _passes.XNNPACKPassManager.__init__
    export_pte(modules, inputs, tmp_path / "fast.pte")
    assert (traceback.NodeSource.__init__, _passes.XNNPACKPassManager.__init__) == originals
    programs = {
        name: views_for_xnnpack(torch.export.export(module, inputs[name], strict=False))
        for name, module in modules.items()
    }
    with lowering_shares_weights():
        lowered = to_edge_transform_and_lower(programs, partitioner=[partitioner("xnnpack")])
        checked = lowered.to_executorch(host_inputs()).buffer
    assert (tmp_path / "fast.pte").read_bytes() == checked
