"""export/graph_attention.py: the ONNX graphs' attention computes what HF's eager attention does."""

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from streamfuse.adapters.masks import GRAPH_MASKED
from streamfuse.adapters.msa import StepKeyValues
from streamfuse.export.graph_attention import grouped_attention
from streamfuse.runtime.backends import graph_passes


@pytest.mark.parametrize("left_over", [None, "other layer", "no layer"])
def test_graph_attention_is_eager_attention(left_over):
    """Also after an ordered provider announced a call that an attention never read (Core ML's graphs
    use HF's own attention): a later call must not take that provider's order."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 3, False
    if left_over is not None:
        slots = torch.zeros(1, 2, 512, 16)
        order = graph_passes.decode_order(torch.tensor([5]), torch.eye(4), torch.zeros(4, dtype=torch.long), 512)
        provider = StepKeyValues(1, 4, [(slots, slots)], write_at=torch.tensor([5]), order=order)
        provider.update(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), 0)
        module.layer_idx = 1 if left_over == "other layer" else None
    query, key, value = torch.randn(1, 6, 4, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    mask = torch.zeros(1, 1, 4, 9).masked_fill(torch.rand(1, 1, 4, 9) < 0.4, GRAPH_MASKED)
    mask[..., 0] = 0.0  # every row sees something
    expected, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.25)
    actual, _ = grouped_attention(module, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
