"""Medusa heads: drafts from the target's last hidden state, through the one decode loop, lossless."""

import pytest
import torch

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.methods.medusa.drafter import HeadDrafter
from streamfuse.methods.medusa.model import MedusaHeads, load_heads, save_heads
from streamfuse.methods.medusa.train import IGNORE, HeadFeatures, HeadTraining, head_features, train_heads
from streamfuse.runtime.backends.base import HEAD_LOGITS
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.data import Encoded

from conftest import make_tiny_llama
from test_decode import backend_for


def medusa(backend, prompt, settings, heads):
    return generate(backend, prompt, settings, drafter=HeadDrafter(settings.tree, heads))


def with_heads(seed: int, noise: float, num_heads: int = 3) -> TorchBackend:
    backend = backend_for(seed, schedule="deferred")
    heads = MedusaHeads(num_heads, 32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, noise)
    backend.attach_heads(heads)
    return backend


@torch.no_grad()
def test_new_heads_are_the_identity_so_each_drafts_the_next_token():
    heads, hidden = MedusaHeads(3, 32), torch.randn(5, 32)
    assert heads(hidden).shape == (5, 3, 32)
    assert all(torch.equal(heads(hidden)[:, j], hidden) for j in range(3))


@pytest.mark.parametrize(
    "tree",
    [
        TreeSpec.chain(3),
        TreeSpec.full(2, 2),
        TreeSpec.parse("[[0],[1],[0,0],[0,0,0]]"),
        TreeSpec.full(3, 1).with_lookup(2),
    ],
)
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_medusa_greedy_equals_plain_greedy(tree, noise):
    backend = with_heads(3, noise)
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    for prompt in ([4, 8, 15, 16], [23, 42]):
        plain = generate(backend, prompt, DecodeSettings("ar", rules))
        fast = medusa(backend, prompt, DecodeSettings("medusa", rules, tree=tree), 3)
        assert (fast.token_ids, fast.stop_reason) == (plain.token_ids, plain.stop_reason)
        assert fast.run.method == "medusa" and fast.run.draft_calls == 0


def test_seeded_medusa_sampling_matches_plain_sampling_token_for_token():
    backend = with_heads(2, 0.3)
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    for seed in range(3):
        rules = StopRules(max_new_tokens=20)
        plain = generate(backend, [4, 5, 6], DecodeSettings("ar", rules, sampling=sampling, seed=seed))
        fast = medusa(
            backend,
            [4, 5, 6],
            DecodeSettings("medusa", rules, tree=TreeSpec.full(3, 2), sampling=sampling, seed=seed),
            3,
        )
        assert fast.token_ids == plain.token_ids


def on_graphs(backend: TorchBackend, trees: tuple[TreeSpec, ...]):
    """The torch backend's model and heads as static graphs with a heads method, run by torch eager."""
    from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec
    from streamfuse.export.verify import EagerRunner
    from streamfuse.runtime.artifact.contract import method_names
    from streamfuse.runtime.backends.static_graph import StaticGraphBackend

    model, schedules = backend.model, ["deferred"] * len(trees)
    shapes = GraphShapes(capacity=96, prefill_chunk=8, buckets=tuple(tree.num_nodes for tree in trees))
    modules = graph_modules(model, shapes, None, schedules, backend.heads)
    assert list(modules) == method_names(shapes.buckets, heads=True)
    return StaticGraphBackend(EagerRunner(modules), graph_spec(model, shapes, schedules, backend.heads.num_heads))


@torch.no_grad()
def test_the_graphs_heads_method_ranks_as_the_torch_heads_at_each_committed_node():
    torch_backend = with_heads(4, 0.5)
    graphs = on_graphs(torch_backend, (TreeSpec.full(2, 2),))
    outputs = [
        backend.prefill([5, 9, 14, 3, 77, 41, 8, 8, 60, 2, 33], with_streams=False)
        for backend in (torch_backend.reset(96) or torch_backend, graphs.reset(96) or graphs)
    ]
    torch.testing.assert_close(
        outputs[0].extras[HEAD_LOGITS](0), outputs[1].extras[HEAD_LOGITS](0), atol=1e-4, rtol=1e-4
    )
    tree = TreeSpec.chain(2)  # runs padded in full(2, 2)'s bucket
    for tokens, path in (([4, 9, 11], [0, 1]), ([7, 7, 2], [0, 1, 2]), ([5, 6, 8], [0])):
        outputs = [backend.step(tokens, tree, with_streams=False) for backend in (torch_backend, graphs)]
        with pytest.raises(RuntimeError, match="before its commit"):
            outputs[1].extras[HEAD_LOGITS](path[-1])
        torch_backend.commit(path)
        graphs.commit(path)
        torch.testing.assert_close(
            outputs[0].extras[HEAD_LOGITS](path[-1]), outputs[1].extras[HEAD_LOGITS](path[-1]), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("tree", [TreeSpec.full(2, 2), TreeSpec.chain(2)])
def test_medusa_on_static_graphs_equals_plain_decoding_greedy_and_seeded(tree):
    graphs = on_graphs(with_heads(5, 0.5), (TreeSpec.full(2, 2),))
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    for prompt in ([4, 8, 15, 16], [23, 42]):
        plain = generate(graphs, prompt, DecodeSettings("ar", rules))
        fast = medusa(graphs, prompt, DecodeSettings("medusa", rules, tree=tree), 3)
        assert (fast.token_ids, fast.run.method) == (plain.token_ids, "medusa")
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    for seed in range(2):
        plain = generate(graphs, [4, 5, 6], DecodeSettings("ar", rules, sampling=sampling, seed=seed))
        fast = medusa(graphs, [4, 5, 6], DecodeSettings("medusa", rules, tree=tree, sampling=sampling, seed=seed), 3)
        assert fast.token_ids == plain.token_ids


def test_trained_heads_draft_the_targets_answer(tmp_path):
    """Heads trained on the target's own answer (its features cached on disk) get most drafts accepted;
    saved and loaded, they draft the same."""
    model = SpeculativeStreamingLM(make_tiny_llama(7), StreamConfig(3, 2)).eval()
    target = TorchBackend(model, kernels="eager")
    prompt, rules = [3, 14, 15, 9, 2, 6], StopRules(max_new_tokens=24)
    answer = generate(target, prompt, DecodeSettings("ar", rules)).token_ids
    item = Encoded("a", prompt + answer, len(prompt))
    cache = tmp_path / "features.safetensors"
    features = head_features(model, [item], 3, cache)
    assert features.hidden.shape == (len(answer), 32) and cache.is_file()
    assert features.targets[0].tolist() == answer[1:4] and features.targets[-1].tolist() == [IGNORE] * 3
    assert torch.equal(head_features(model, [item], 3, cache).hidden, features.hidden)  # from the cache
    settings = DecodeSettings("medusa", rules, tree=TreeSpec.chain(3))

    def accepted(heads) -> int:
        target.attach_heads(heads)
        fast = medusa(target, prompt, settings, 3)
        assert fast.token_ids == answer
        return sum(step.accepted_depth for step in fast.run.steps)

    heads = MedusaHeads(3, 32)
    untrained = accepted(heads)
    result = train_heads(heads, model.parts.lm_head, features, HeadTraining(epochs=300, learning_rate=1e-2, batch=64))
    assert result["final_losses"]["head_1"] < 1.0
    trained = accepted(heads)
    assert trained >= max(untrained + 4, 12)  # of the 23 tokens after the prefill's
    save_heads(heads, tmp_path / "medusa", {"note": "test"})
    assert accepted(load_heads(tmp_path / "medusa")) == trained


def test_medusa_without_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="needs Medusa heads"):
        medusa(backend_for(0), [1, 2], DecodeSettings("medusa", StopRules(4), tree=TreeSpec.chain(2)), 3)


def test_an_lm_head_that_passes_no_gradient_is_refused():
    """A packed inference kernel returns outputs without a gradient path to the heads: training through
    it would leave them untrained, silently."""

    class Detached(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, hidden):
            return self.inner(hidden).detach().requires_grad_()

    model = SpeculativeStreamingLM(make_tiny_llama(1), StreamConfig(3, 2))
    features = HeadFeatures(torch.randn(8, 32), torch.randint(0, 97, (8, 2)))
    with pytest.raises(ValueError, match="got no gradient"):
        train_heads(MedusaHeads(2, 32), Detached(model.parts.lm_head), features, HeadTraining(epochs=1, batch=4))
