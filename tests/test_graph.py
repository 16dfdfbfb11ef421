"""The exported graphs' greedy step, run by torch eager: equal to step + accept + commit + streams,
for both stream schedules, with and without a draft vocabulary."""

import random

import pytest
import torch
from conftest import make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.graph import GraphShapes, GreedyStepPass, graph_modules, graph_spec, greedy_schedule
from streamfuse.export.verify import EagerSession
from streamfuse.runtime.accept import accept
from streamfuse.runtime.backends.static_graph import StaticGraphBackend, base_method, method_names
from streamfuse.runtime.tree import TreeSpec

TREES = [TreeSpec.full(3, 2), TreeSpec.chain(3), TreeSpec(((0,), (1,), (0, 0), (1, 0), (1, 0, 0), (1, 0, 1)))]


def tiny_model() -> SpeculativeStreamingLM:
    return SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2)).eval()


def backend_for(model, tree: TreeSpec, draft_ids=None, schedule="deferred") -> tuple[StaticGraphBackend, EagerSession]:
    shapes = GraphShapes(capacity=64, prefill_chunk=8, trees=(tree,))
    session = EagerSession(graph_modules(model, shapes, draft_ids, [schedule]))
    return StaticGraphBackend(session, graph_spec(model, shapes, [schedule]), use_greedy_step=False), session


def draft_the_targets(session, backend, tree: TreeSpec, root: int, rng: random.Random) -> list[int]:
    """Tree tokens where, mostly, one random child of each node carries that node's target (so
    acceptance goes deep, along any branch); other children get distinct other tokens. Built
    depth by depth: a node's target depends only on its ancestors' tokens."""
    tokens = [root] + [0] * (tree.num_nodes - 1)
    for depth in range(tree.depth):
        inputs = [torch.tensor([tokens]), torch.tensor([backend.length]), backend.keys, backend.values]
        targets = session.run("step_0", inputs)[0].argmax(-1).tolist()
        for parent in (n for n in range(tree.num_nodes) if tree.depths[n] == depth and tree.children[n]):
            children = tree.children[parent]
            matching = rng.choice(children) if rng.random() < 0.8 else None
            others = iter(t for t in rng.sample(range(3, 97), 20) if t != targets[parent])
            for child in children:
                tokens[child] = targets[parent] if child == matching else next(others)
    return tokens


def reference_drafts(step, node: int, width: int, draft_ids) -> torch.Tensor:
    """The separate streams call's logits, ranked over the draft vocabulary (or all tokens)."""
    if draft_ids is None:
        return step.stream_top(node, width)
    ids = torch.tensor(draft_ids)
    return ids[step.stream_logits(node)[:, ids].topk(width, dim=-1).indices]


@torch.no_grad()
@pytest.mark.parametrize("schedule", ["deferred", "fused"])
@pytest.mark.parametrize("draft_ids", [None, list(range(0, 97, 2))], ids=["all-tokens", "draft-vocab"])
@pytest.mark.parametrize("tree", TREES, ids=["full-3-2", "chain-3", "custom"])
def test_greedy_step_equals_step_then_accept_commit_and_streams(tree, draft_ids, schedule):
    model = tiny_model()
    backend, session = backend_for(model, tree, draft_ids, schedule)
    rng, depths = random.Random(0), []
    backend.reset(64)
    backend.prefill([5, 9, 14, 3, 77, 41, 8, 8, 60, 2, 33], with_streams=False)
    root = 17
    for _ in range(6):
        tokens = draft_the_targets(session, backend, tree, root, rng)
        inputs = [torch.tensor([tokens]), torch.tensor([backend.length]), backend.keys.clone(), backend.values.clone()]
        targets, accepted, drafts, new_keys, new_values, states = session.run("greedy_step_0", inputs)
        reference = backend.step(tokens, tree, with_streams=True)  # the separate step + streams calls
        assert targets.tolist() == reference.main_logits.argmax(-1).tolist()
        torch.testing.assert_close(new_keys, backend._pending[0], atol=1e-5, rtol=0)
        result = accept(tree, tokens, lambda n: int(reference.main_logits[n].argmax()))
        assert accepted.tolist() == [result.path[-1]]
        backend.commit(result.path)
        assert torch.equal(drafts, reference_drafts(reference, result.path[-1], max(tree.widths), draft_ids))
        torch.testing.assert_close(states, reference.stream_states(result.path[-1]), atol=1e-5, rtol=0)
        depths.append(len(result.path) - 1)
        root = result.correction
    assert max(depths) == tree.depth and min(depths) < tree.depth  # deep and shallow acceptance both seen


@st.composite
def tree_and_tokens(draw):
    tree = draw(st.sampled_from(TREES))
    tokens, targets = [draw(st.integers(0, 2))], []
    for node in range(1, tree.num_nodes):
        siblings = {tokens[s] for s in tree.children[tree.parents[node]] if s < node}
        tokens.append(draw(st.sampled_from([t for t in range(4) if t not in siblings])))
    targets = draw(st.lists(st.integers(0, 3), min_size=tree.num_nodes, max_size=tree.num_nodes))
    return tree, tokens, targets


PASSES = {tree.hash(): GreedyStepPass(tiny_model(), tree, capacity=32) for tree in TREES}


@settings(max_examples=300, deadline=None)
@given(tree_and_tokens())
def test_in_graph_acceptance_is_the_host_greedy_rule(case):
    """Over a 4-token vocabulary, so that partial and full matches are common."""
    tree, tokens, targets = case
    node = PASSES[tree.hash()].accepted_node(torch.tensor(tokens), torch.tensor(targets))
    assert node.tolist() == [accept(tree, tokens, lambda n: targets[n]).path[-1]]


def test_auto_schedule_fuses_small_trees_only():
    assert greedy_schedule(TreeSpec.chain(3), "auto") == "fused"
    assert greedy_schedule(TreeSpec.full(3, 2), "auto") == "deferred"
    assert greedy_schedule(TreeSpec.full(3, 2), "fused") == "fused"
    with pytest.raises(ValueError, match="must be one of auto, fused, deferred"):
        greedy_schedule(TreeSpec.chain(3), "eager")


# method name -> the method whose tensors it has
BASE_METHODS = [("prefill", "prefill"), ("step_0", "step"), ("greedy_step_12", "greedy_step"), ("streams", "streams"),
                ("decode_1", "decode_1")]


@pytest.mark.parametrize("name, base", BASE_METHODS)
def test_tree_methods_are_named_by_their_tree(name, base):
    assert base_method(name) == base


class CountingSession(EagerSession):
    def __init__(self, modules):
        super().__init__(modules)
        self.calls = []

    def run(self, method, inputs):
        self.calls.append(method)
        return super().run(method, inputs)


@torch.no_grad()
def test_each_tree_runs_its_own_graphs_and_an_unknown_tree_is_a_clear_error():
    model, trees = tiny_model(), (TreeSpec.chain(3), TreeSpec.full(2, 2))
    shapes = GraphShapes(capacity=64, prefill_chunk=8, trees=trees)
    modules = graph_modules(model, shapes, None, ["fused", "deferred"])
    assert list(modules) == method_names(2)
    session = CountingSession(modules)
    backend = StaticGraphBackend(session, graph_spec(model, shapes, ["fused", "deferred"]))
    backend.reset(64)
    backend.prefill([1, 2, 3], with_streams=False)
    for index, tree in enumerate(trees):
        backend.step([4] * tree.num_nodes, tree, with_streams=True, greedy=True)
        backend.step([4] * tree.num_nodes, tree, with_streams=True)
        assert session.calls[-2:] == [f"greedy_step_{index}", f"step_{index}"]
    with pytest.raises(ValueError, match="has step graphs for the trees .* none holding \\[\\[0\\], \\[0, 0\\], "):
        backend.step([4] * 5, TreeSpec.chain(4), with_streams=True)
    backend.step([4, 5], TreeSpec.chain(1), with_streams=True, greedy=True)  # held by chain(3): its padded step
    assert session.calls[-1] == "step_0"
    with pytest.raises(ValueError, match="repeat a shape"):
        GraphShapes(capacity=64, prefill_chunk=8, trees=(TreeSpec.chain(3), TreeSpec.chain(3)))


def spec_for(model, trees, schedules):
    return graph_spec(model, GraphShapes(capacity=64, prefill_chunk=8, trees=trees), schedules)


# (the exported trees, a tree they hold but do not have) -> the graph that runs it and each node's graph node
HELD = [
    ((TreeSpec.chain(3),), TreeSpec.chain(1), 0, [0, 1]),
    ((TreeSpec.full(2, 2), TreeSpec.chain(3)), TreeSpec.chain(2), 1, [0, 1, 2]),  # the smaller holder
    ((TreeSpec.full(2, 2),), TreeSpec(((1,), (1, 0))), 0, [0, 2, 5]),
    ((TreeSpec.full(2, 2),), TreeSpec(((0,), (1,)), lookup=(1,)), 0, [0, 1, 2]),  # paths alone decide
]


@pytest.mark.parametrize("trees, tree, index, nodes", HELD)
def test_a_tree_runs_padded_in_the_smallest_graph_holding_it(trees, tree, index, nodes):
    model = tiny_model()
    assert spec_for(model, trees, ("deferred",) * len(trees)).graph_for(tree) == (index, nodes)


@torch.no_grad()
def test_a_padded_step_gives_the_trees_own_outputs_and_decodes_losslessly():
    """chain(2) through chain(3)'s graph and through its own: the same logits, streams and cache, step after
    step; decoding with it equals plain decoding."""
    from streamfuse.runtime.decode import generate
    from streamfuse.runtime.emitter import StopRules
    from streamfuse.runtime.settings import DecodeSettings

    model, tree = tiny_model(), TreeSpec.chain(2)
    backends = []
    for trees in ((tree,), (TreeSpec.full(2, 2), TreeSpec.chain(3))):
        shapes = GraphShapes(capacity=64, prefill_chunk=8, trees=trees)
        session = EagerSession(graph_modules(model, shapes, None, ["deferred"] * len(trees)))
        backends.append(StaticGraphBackend(session, spec_for(model, trees, ("deferred",) * len(trees))))
    own, padded = backends
    for backend in backends:
        backend.reset(64)
        backend.prefill([1, 2, 3], with_streams=False)
    for tokens, path in (([4, 9, 11], [0, 1]), ([7, 7, 2], [0, 1, 2]), ([5, 6, 8], [0])):
        first, second = own.step(tokens, tree, with_streams=True), padded.step(tokens, tree, with_streams=True)
        torch.testing.assert_close(first.main_logits, second.main_logits, atol=1e-5, rtol=1e-5)
        own.commit(path)
        padded.commit(path)
        torch.testing.assert_close(first.stream_logits(path[-1]), second.stream_logits(path[-1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own.keys[:, :, : own.length], padded.keys[:, :, : padded.length])
    rules = StopRules(max_new_tokens=20)
    for prompt in ([3, 1, 4], [9, 9, 2, 6]):
        plain = generate(padded, prompt, DecodeSettings("ar", rules))
        assert generate(padded, prompt, DecodeSettings("ss", rules, tree=tree)).token_ids == plain.token_ids
