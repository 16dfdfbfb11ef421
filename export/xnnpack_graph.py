"""Keep each exported method inside a few XNNPACK partitions.

XNNPACK's partitioner takes only ops it has kernels for, and every op it refuses splits the graph:
the refused op runs on ExecuTorch's portable (single-threaded reference) kernels, and each piece
between two of them is preprocessed and called on its own. With the Hugging Face modules as they
are, SmolLM2-135M's decode method falls into 184 pieces (about 6 per layer): lowering it takes
169 s and a call 70 ms, against 83 s and 27 ms in the 3 pieces the replacements below leave. The
refusals and their replacements (same arithmetic):

- RMSNorm's mean over the last dim (XNNPACK means only 4D tensors over dims 2 and 3): the
  squares are reshaped to [1, rows, H, 1] and averaged over (2, 3);
- SDPA's decomposition (a "safe softmax" for fully masked rows: any / where / logical_not) and
  4D matmuls (expand_copy): attention is streamfuse's exact kernel over the cache's used span
  (export/span_attention.py), one op per layer between two XNNPACK partitions, registered into
  ExecuTorch's runtime by runtime/ops/tree_attention.py;
- unsqueeze on any but the trailing dim (the rotary embedding's cos / sin, per layer): a view;
- alias copies of the new K/V rows: dropped.

The first two are module swaps on a copy of the model (the model itself stays as trained); the
last two rewrite the exported ATen graph. ExecuTorch parity against torch eager is checked at
export (export/verify.py).
"""

from __future__ import annotations

import torch
from torch import nn

from streamfuse.adapters import hf
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.span_attention import span_model


class PooledRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, with the mean as a 4D average over dims (2, 3)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.register_buffer("eps", torch.tensor(hf.rms_norm_epsilon(norm), dtype=norm.weight.dtype), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        size = hidden.shape[-1]
        squares = (hidden * hidden).reshape(1, -1, size, 1)
        variance = squares.mean(dim=(2, 3), keepdim=True).reshape(*hidden.shape[:-1], 1)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps))


def xnnpack_model(model: SpeculativeStreamingLM) -> SpeculativeStreamingLM:
    """A copy of `model` whose RMSNorms lower to XNNPACK whole and whose attention is the span kernel (its
    graphs need GraphShapes.span)."""
    ready = span_model(model)
    ready.replace_modules(hf.is_rms_norm, PooledRMSNorm)
    return ready


def engine_model(model: SpeculativeStreamingLM, engine: str) -> SpeculativeStreamingLM:
    """A copy of `model` as the build exports it, fp32, for `engine`: XNNPACK's modules on ExecuTorch, the span
    kernel's attention on both (the tools that time graphs without a build: span_sweep, draft_latency)."""
    return xnnpack_model(model) if engine == "executorch" else span_model(model)


def views_for_xnnpack(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """In place on the ATen graph: unsqueeze -> view of the same shape, alias -> its input."""
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.target == torch.ops.aten.unsqueeze.default:
            node.target = torch.ops.aten.view.default
            node.args = (node.args[0], list(node.meta["val"].shape))
        elif node.target == torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    program.graph_module.recompile()
    return program
