"""export/eager.py: the torch backend is the static-graph host over the graphs' functions run
eagerly, so it computes what the exported graphs' modules compute, keeps its cache in place, and prunes."""

import numpy as np
import pytest
import torch

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec
from streamfuse.export.verify import EagerRunner
from streamfuse.runtime.backends.base import CapacityError, PruneConfig
from streamfuse.runtime.backends.static_graph import StaticGraphBackend, keep_nodes
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
# tree, its tokens, the nodes the host commits (a path: root, then one node per depth)
CASES = [
    (TreeSpec.chain(3), [7, 8, 9, 10], [0, 1, 2]),
    (TreeSpec.full(3, 2), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [0, 2, 5]),
    (TreeSpec(((0,), (1,), (0, 0), (1, 0), (1, 0, 0), (1, 0, 1))), [7, 8, 9, 10, 11, 12, 13], [0, 2, 4, 6]),
]


def tiny_model() -> SpeculativeStreamingLM:
    return SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2)).eval()


def exported_modules(model, tree: TreeSpec) -> StaticGraphBackend:
    """The exported graphs' modules (static shapes, the cache appended to) run by torch: the reference."""
    shapes = GraphShapes(capacity=64, prefill_chunk=8, buckets=(tree.num_nodes,))
    session = EagerRunner(graph_modules(model, shapes, None, ["deferred"]))
    return StaticGraphBackend(session, graph_spec(model, shapes, ["deferred"]), use_greedy_step=False)


@torch.no_grad()
@pytest.mark.parametrize("tree, tokens, path", CASES, ids=["chain-3", "full-3-2", "custom"])
def test_steps_equal_the_exported_modules_and_the_cache_holds_the_committed_rows(tree, tokens, path):
    model = tiny_model()
    torch_backend, reference = TorchBackend(model, kernels="eager"), exported_modules(model, tree)
    for backend in (torch_backend, reference):
        backend.reset(40)
        backend.prefill(PROMPT, with_streams=True)
    outs = [backend.step(tokens, tree, with_streams=True) for backend in (torch_backend, reference)]
    np.testing.assert_allclose(outs[0].main_logits, outs[1].main_logits, atol=1e-5)
    for backend in (torch_backend, reference):
        backend.commit(path)
    np.testing.assert_allclose(outs[0].stream_logits(path[-1]), outs[1].stream_logits(path[-1]), atol=1e-5)
    length = len(PROMPT) + len(path)
    assert torch_backend.length == reference.length == length
    np.testing.assert_allclose(torch_backend.keys[:, :, :length].numpy(), reference.keys[:, :, :length], atol=1e-5)
    np.testing.assert_allclose(torch_backend.values[:, :, :length].numpy(), reference.values[:, :, :length], atol=1e-5)


@torch.no_grad()
def test_a_step_writes_only_the_free_slots_and_a_greedy_step_drafts_what_step_then_streams_draft():
    model, (tree, tokens, _) = tiny_model(), CASES[2]
    backend = TorchBackend(model, stream_schedule="deferred", kernels="eager")
    backend.reset(40)
    backend.prefill(PROMPT, with_streams=True)
    committed = backend.keys[:, :, : len(PROMPT)].clone()
    step = backend.step(tokens, tree, with_streams=True)
    assert torch.equal(backend.keys[:, :, : len(PROMPT)], committed)  # the call's rows went past them
    greedy = [int(step.main_logits[n].argmax()) for n in range(tree.num_nodes)]
    backend.rollback(len(PROMPT))
    fused = backend.step(tokens, tree, with_streams=True, greedy=True)
    assert list(fused.greedy_tokens) == greedy
    accepted = [0]
    while any(tokens[c] == greedy[accepted[-1]] for c in tree.children[accepted[-1]]):
        accepted.append(next(c for c in tree.children[accepted[-1]] if tokens[c] == greedy[accepted[-1]]))
    backend.commit(accepted)
    separate = TorchBackend(model, stream_schedule="deferred", kernels="eager")
    separate.reset(40)
    separate.prefill(PROMPT, with_streams=True)
    plain = separate.step(tokens, tree, with_streams=True)
    separate.commit(accepted)
    np.testing.assert_array_equal(fused.stream_top(accepted[-1], 2), plain.stream_top(accepted[-1], 2))


@torch.no_grad()
@pytest.mark.parametrize("prune", [PruneConfig(threshold=0.012), PruneConfig(budget=3)], ids=["threshold", "budget"])
def test_pruning_keeps_the_nodes_the_early_exit_head_allows(prune):
    model, (tree, tokens, _) = tiny_model(), CASES[1]
    backend = TorchBackend(model, kernels="eager")
    backend.reset(40)
    backend.prefill(PROMPT, with_streams=False)
    kept = backend.step(tokens, tree, with_streams=False, prune=prune).kept
    # The early-exit head's probabilities at each node, by hand: a plain forward with the tree's mask.
    visible = torch.from_numpy(tree.ancestor_mask)
    mask = torch.cat([torch.ones(len(tokens), len(PROMPT), dtype=torch.bool), visible], dim=1)
    ids, positions = (
        torch.tensor([PROMPT + tokens]),
        torch.tensor([list(range(len(PROMPT))) + [len(PROMPT) + d for d in tree.depths]]),
    )
    full = torch.cat(
        [
            torch.cat(
                [
                    torch.ones(len(PROMPT), len(PROMPT)).tril().bool(),
                    torch.zeros(len(PROMPT), len(tokens), dtype=torch.bool),
                ],
                dim=1,
            ),
            mask,
        ]
    )
    additive = torch.zeros(full.shape).masked_fill(~full, float("-inf"))[None, None]
    early = model.forward_lower(ids, positions, additive, None, with_pruning=True).pruning_hidden[0, len(PROMPT) :]
    probs = torch.softmax(model.logits(early), dim=-1)
    transition = [1.0] + [float(probs[tree.parents[n], tokens[n]]) for n in range(1, tree.num_nodes)]
    assert kept == keep_nodes(tree, transition, prune)
    assert not all(kept)  # the case prunes something


def test_the_cache_grows_on_reset_and_a_full_cache_is_a_clear_error():
    backend = TorchBackend(tiny_model(), kernels="eager")
    backend.reset(12)
    backend.prefill(PROMPT, with_streams=False)
    with pytest.raises(CapacityError, match="KV cache full: 11 committed \\+ 4 new > capacity 12"):
        backend.step([1, 2, 3, 4], TreeSpec.chain(3), with_streams=False)
    backend.reset(64)
    assert backend.keys.shape[2] == 64 and backend.length == 0


@torch.no_grad()
def test_a_tree_wider_than_the_greedy_drafts_runs_step_then_streams():
    backend = TorchBackend(tiny_model(), kernels="eager")
    wide = TreeSpec(tuple((rank,) for rank in range(backend.spec.width + 1)))
    assert not backend.spec.drafts_from(wide) and backend.stream_schedule(wide) == "deferred"
    backend.reset(64)
    backend.prefill(PROMPT, with_streams=True)
    out = backend.step(list(range(1, wide.num_nodes + 1)), wide, with_streams=True, greedy=True)
    assert out.main_logits is not None and out.greedy_tokens is None  # logits, not the greedy step's ids
