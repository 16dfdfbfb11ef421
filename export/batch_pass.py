"""The batched step (runtime/artifact/contract.py batch_method): B sequences' trees of T rows in one call, for the
engine-cache
graphs (ExecuTorch, ONNX Runtime). Every linear sees the B * T rows at once, so the weights are read once for all
sequences; attention runs per sequence (BatchSpanKeyValues: the exact kernel over that sequence's own cache, from
its own start, among its own rows), so row b * T + t is row t of sequence b's own step_T call, bit for bit, as long
as the linears compute a row alone (every engine's kernels here do: export/to_onnx.py ACCURACY_LEVEL)."""

from __future__ import annotations

import torch
from torch import nn

from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.msa import BatchSpanKeyValues
from streamfuse.export.passes import tree_mask
from streamfuse.runtime.artifact.contract import batch_inputs
from streamfuse.runtime.ops.tree_attention import commit_op
from streamfuse.runtime.speculation.tree import TreeSpec


class BatchStepPass(nn.Module):
    """batch_step_{B}x{T}: forward(ids [1, B*T], cache_len [B], tree [B, T, T], depths [B, T], keys_0, values_0, ..,
    keys_{B-1}, values_{B-1}, commit [B, max_nodes]) -> logits [B*T, V], anchor [B*T, H], hidden [B*T, H]."""

    def __init__(self, model: SpeculativeStreamingLM, sequences: int, rows: int):
        super().__init__()
        self.model, self.sequences, self.rows = model, sequences, rows

    def forward(self, ids: torch.Tensor, cache_len: torch.Tensor, tree: torch.Tensor, depths: torch.Tensor, *rest):
        count = self.sequences
        if len(rest) != 2 * count + 1:
            raise ValueError(f"batch_step of {count} sequences takes {2 * count} cache tensors and the commit")
        caches = [(rest[2 * index], rest[2 * index + 1]) for index in range(count)]
        commit = rest[-1]
        # Each sequence's pending commit first, on its own cache: its attention takes the result as start.
        starts = [
            commit_op()(keys, values, cache_len[index : index + 1], commit[index])
            for index, (keys, values) in enumerate(caches)
        ]
        positions = (cache_len[:, None] + depths).reshape(1, count * self.rows)
        visible = [tree[index] for index in range(count)]
        provider = BatchSpanKeyValues(self.model.parts.num_layers, self.rows, caches, starts, visible)
        # The kernel reads each sequence's mask from the provider; the layers get the whole call's, each sequence's
        # tree on the diagonal (what an attention that is not the kernel's would need: eager checks of the shapes).
        mask = tree_mask(torch.block_diag(*visible))[None, None]
        lower = self.model.forward_lower(ids, positions, mask, provider)
        hidden = self.model.forward_upper(lower).hidden[0]
        return self.model.logits(hidden), lower.hidden[0], hidden


def batch_example(model: SpeculativeStreamingLM, sequences: int, rows: int, keys, values, max_nodes: int) -> tuple:
    """Inputs with a batched step's exported shapes and dtypes: each sequence a chain one row short of the bucket
    (so a pad row), distinct cache tensors (torch.export would fold aliased inputs; uninitialised, so their pages
    stay unused until a check runs the module on copies), commits moving nothing."""
    chain = TreeSpec.chain(max(rows - 2, 1)) if rows > 1 else TreeSpec(())
    tree, depths = map(torch.from_numpy, batch_inputs([chain] * sequences, rows))
    caches = [torch.empty_like(tensor) for _ in range(sequences) for tensor in (keys, values)]
    length = torch.full((sequences,), 1, dtype=torch.long)
    commit = torch.full((sequences, max_nodes), -1, dtype=torch.long)
    return (torch.zeros(1, sequences * rows, dtype=torch.long), length, tree, depths, *caches, commit)
