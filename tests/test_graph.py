"""The exported graphs' greedy step, run by torch eager: equal to step + accept + commit + streams,
for both stream schedules, with and without a draft vocabulary; trees as data in size buckets; the span graphs'
cache, kept by the engine, equal to the host's."""

import random
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec, greedy_schedule
from streamfuse.export.passes import accepted_node
from streamfuse.export.verify import EagerRunner
from streamfuse.runtime.artifact.contract import base_method, method_names, tree_inputs
from streamfuse.runtime.backends.base import STREAM_STATES
from streamfuse.runtime.backends.static_graph import StaticGraphBackend, lazy_zeros
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.accept import accept
from streamfuse.runtime.speculation.sampling import ranked
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama

TREES = [TreeSpec.full(3, 2), TreeSpec.chain(3), TreeSpec(((0,), (1,), (0, 0), (1, 0), (1, 0, 0), (1, 0, 1)))]


def tiny_model() -> SpeculativeStreamingLM:
    return SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2)).eval()


def backend_for(model, tree: TreeSpec, draft_ids=None, schedule="deferred") -> tuple[StaticGraphBackend, EagerRunner]:
    shapes = GraphShapes(capacity=64, prefill_chunk=8, buckets=(tree.num_nodes,))
    session = EagerRunner(graph_modules(model, shapes, draft_ids, [schedule]))
    return StaticGraphBackend(session, graph_spec(model, shapes, [schedule]), use_greedy_step=False), session


def draft_the_targets(session, backend, tree: TreeSpec, root: int, rng: random.Random) -> list[int]:
    """Tree tokens where, mostly, one random child of each node carries that node's target (so
    acceptance goes deep, along any branch); other children get distinct other tokens. Built
    depth by depth: a node's target depends only on its ancestors' tokens."""
    tokens = [root] + [0] * (tree.num_nodes - 1)
    for depth in range(tree.depth):
        visible, depths, _ = tree_inputs(tree, tree.num_nodes)
        inputs = [torch.tensor([tokens]), torch.tensor([backend.length]), visible, depths, backend.keys, backend.values]
        targets = session.run(f"step_{tree.num_nodes}", inputs)[0].argmax(-1).tolist()
        for parent in (n for n in range(tree.num_nodes) if tree.depths[n] == depth and tree.children[n]):
            children = tree.children[parent]
            matching = rng.choice(children) if rng.random() < 0.8 else None
            others = iter(t for t in rng.sample(range(3, 97), 20) if t != targets[parent])
            for child in children:
                tokens[child] = targets[parent] if child == matching else next(others)
    return tokens


def reference_drafts(step, node: int, width: int, draft_ids) -> np.ndarray:
    """The separate streams call's logits, ranked over the draft vocabulary (or all tokens)."""
    if draft_ids is None:
        return step.stream_top(node, width)
    ids = np.array(draft_ids)
    return ids[ranked(step.stream_logits(node)[:, ids], width)]


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
        inputs = [
            np.array([tokens]),
            np.array([backend.length]),
            *tree_inputs(tree, tree.num_nodes),
            backend.keys.copy(),
            backend.values.copy(),
        ]
        targets, accepted, drafts, new_keys, new_values, states = session.run(f"greedy_step_{tree.num_nodes}", inputs)
        reference = backend.step(tokens, tree, with_streams=True)  # the separate step + streams calls
        assert targets.tolist() == reference.main_logits.argmax(-1).tolist()
        torch.testing.assert_close(new_keys, backend._pending["new_keys"], atol=1e-5, rtol=0)
        result = accept(tree, tokens, lambda n: int(reference.main_logits[n].argmax()))
        assert accepted.tolist() == [result.path[-1]]
        backend.commit(result.path)
        assert drafts.shape[1] == max(9, tree.num_nodes - 1)  # the widest level the artifact's trees may have
        assert np.array_equal(drafts, reference_drafts(reference, result.path[-1], drafts.shape[1], draft_ids))
        torch.testing.assert_close(states, reference.extras[STREAM_STATES](result.path[-1]), atol=1e-5, rtol=0)
        depths.append(len(result.path) - 1)
        root = result.correction
    assert max(depths) == tree.depth and min(depths) < tree.depth  # deep and shallow acceptance both seen


@st.composite
def tree_and_tokens(draw):
    tree = draw(st.sampled_from(TREES))
    rows = tree.num_nodes + draw(st.integers(0, 3))  # the bucket: pad rows after the tree's nodes
    tokens, targets = [draw(st.integers(0, 2))], []
    for node in range(1, tree.num_nodes):
        siblings = {tokens[s] for s in tree.children[tree.parents[node]] if s < node}
        tokens.append(draw(st.sampled_from([t for t in range(4) if t not in siblings])))
    tokens += draw(st.lists(st.integers(0, 3), min_size=rows - tree.num_nodes, max_size=rows - tree.num_nodes))
    targets = draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows))
    return tree, rows, tokens, targets


@settings(max_examples=300, deadline=None)
@given(tree_and_tokens())
def test_in_graph_acceptance_is_the_host_greedy_rule(case):
    """Over a 4-token vocabulary, so that partial and full matches are common; pad rows, whatever their
    tokens and targets, are never accepted."""
    tree, rows, tokens, targets = case
    node = accepted_node(torch.tensor(tokens), torch.tensor(targets), *map(torch.from_numpy, tree_inputs(tree, rows)))
    assert node.tolist() == [accept(tree, tokens[: tree.num_nodes], lambda n: targets[n]).path[-1]]


def test_auto_schedule_fuses_small_buckets_only():
    assert greedy_schedule(4, "auto") == "fused"
    assert greedy_schedule(8, "auto") == "deferred"
    assert greedy_schedule(8, "fused") == "fused"
    with pytest.raises(ValueError, match="must be one of auto, fused, deferred"):
        greedy_schedule(4, "eager")


# (tree, bucket) -> the inputs the step graph takes: ancestors and itself per row, pad rows alone at depth -1
TREE_INPUTS = [
    (TreeSpec.chain(2), 3, [[1, 0, 0], [1, 1, 0], [1, 1, 1]], [0, 1, 2], [0, 0, 1]),
    (TreeSpec.chain(1), 4, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]], [0, 1, -1, -1], [0, 0, 0, 0]),
    (
        TreeSpec(((0,), (1,), (1, 0))),
        4,
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]],
        [0, 1, 1, 2],
        [0, 0, 0, 2],
    ),
]


@pytest.mark.parametrize("tree, rows, visible, depths, parents", TREE_INPUTS)
def test_a_tree_is_data_padded_to_its_bucket(tree, rows, visible, depths, parents):
    got = tree_inputs(tree, rows)
    assert got[0].tolist() == visible and got[1].tolist() == depths and got[2].tolist() == parents
    with pytest.raises(ValueError, match=f"does not fit a bucket of {tree.num_nodes - 1} rows"):
        tree_inputs(tree, tree.num_nodes - 1)


# method name -> the method whose tensors it has
BASE_METHODS = [
    ("prefill", "prefill"),
    ("step_4", "step"),
    ("greedy_step_12", "greedy_step"),
    ("streams", "streams"),
    ("decode_1", "decode_1"),
]


@pytest.mark.parametrize("name, base", BASE_METHODS)
def test_bucket_methods_are_named_by_their_rows(name, base):
    assert base_method(name) == base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")
def test_the_host_cache_holds_the_pages_of_the_rows_written_not_its_capacity():
    """SmolLM2's cache at 2,048 slots (47 MiB): 16 rows written in each (layer, KV head) block fill one page
    of each, not the blocks (NumPy's own large arrays take huge pages: a 2 MiB page per first write)."""
    from streamfuse.tools.process_memory import resident_bytes

    keys = lazy_zeros((30, 3, 2048, 64))
    assert keys.dtype == np.float32 and keys.flags.writeable and resident_bytes(keys) == 0
    keys[:, :, :16] = 1.0
    assert resident_bytes(keys) == 30 * 3 * 4096
    assert keys[0, 0, 15, 63] == 1.0 and keys[29, 2, 16, 0] == 0.0


def test_buckets_are_distinct_ascending_and_fit_the_cache():
    for buckets in ((), (8, 4), (4, 4), (1, 4)):
        with pytest.raises(ValueError, match="distinct row counts >= 2"):
            GraphShapes(capacity=64, prefill_chunk=8, buckets=buckets)
    with pytest.raises(ValueError, match="plus the largest step \\(60 rows\\)"):
        GraphShapes(capacity=64, prefill_chunk=8, buckets=(4, 60))
    # greedy_step drafts the widest level calibration's trees reach (ranks up to MAX_RANK - 1, a lookup branch
    # one further), or more where the largest bucket holds a wider tree
    from streamfuse.training.calibration import MAX_RANK

    assert GraphShapes(capacity=64, prefill_chunk=8, buckets=(4, 8)).width == MAX_RANK + 1 == 9
    assert GraphShapes(capacity=64, prefill_chunk=8, buckets=(4, 16)).width == 15


class CountingRunner(EagerRunner):
    def __init__(self, modules):
        super().__init__(modules)
        self.calls = []

    def run(self, method, inputs):
        self.calls.append(method)
        return super().run(method, inputs)


@torch.no_grad()
def test_each_tree_runs_in_the_smallest_bucket_holding_it_and_a_larger_one_is_a_clear_error():
    model, buckets = tiny_model(), (4, 8)
    shapes = GraphShapes(capacity=64, prefill_chunk=8, buckets=buckets)
    modules = graph_modules(model, shapes, None, ["fused", "deferred"])
    assert list(modules) == method_names(buckets)
    session = CountingRunner(modules)
    backend = StaticGraphBackend(session, graph_spec(model, shapes, ["fused", "deferred"]))
    backend.reset(64)
    backend.prefill([1, 2, 3], with_streams=False)
    for tree, rows in (
        (TreeSpec.chain(1), 4),
        (TreeSpec.chain(3), 4),
        (TreeSpec.full(2, 2), 8),
        (TreeSpec(((0,), (1,), (0, 0), (1, 0))), 8),
    ):
        backend.step([4] * tree.num_nodes, tree, with_streams=True, greedy=True)
        backend.step([4] * tree.num_nodes, tree, with_streams=True)
        assert session.calls[-2:] == [f"greedy_step_{rows}", f"step_{rows}"]
        assert backend.stream_schedule(tree) == ("fused" if rows == 4 else "deferred")
    with pytest.raises(
        ValueError, match="a tree of 9 nodes is larger than the artifact's largest step graph \\(8 rows"
    ):
        backend.step([4] * 9, TreeSpec.chain(8), with_streams=True)
    wide = TreeSpec(((0,), (11,)))  # rank 11: wider than greedy_step's 9 drafts, so step + streams
    assert backend.stream_schedule(wide) == "deferred"
    backend.step([4, 5, 6], wide, with_streams=True, greedy=True)
    assert session.calls[-1] == "step_4"


@torch.no_grad()
def test_a_run_reserves_its_trees_bucket_rows_so_it_never_stops_half_way():
    """A 3-node tree runs in the 4-row graph: a run that fits with 3 scratch rows but not with 4 is refused
    before any work, not stopped by a full cache at its last step."""
    model = tiny_model()
    shapes = GraphShapes(capacity=64, prefill_chunk=8, buckets=(4,))
    backend = StaticGraphBackend(
        EagerRunner(graph_modules(model, shapes, None, ["fused"])), graph_spec(model, shapes, ["fused"])
    )
    tree = TreeSpec.chain(2)
    assert backend.step_rows(tree) == 4 and backend.step_rows(None) == 1
    ss = DecodeSettings("ss", StopRules(10), tree=tree)
    with pytest.raises(ValueError, match="a step's 4 rows exceeds the model's context of 64"):
        generate(backend, [1] * 51, ss)  # 51 + 10 + 3 = 64 would fit; 51 + 10 + 4 does not
    assert 1 <= len(generate(backend, [1] * 50, ss).token_ids) <= 10


def spec_for(model, buckets):
    return graph_spec(model, GraphShapes(capacity=64, prefill_chunk=8, buckets=buckets), ("deferred",) * len(buckets))


@torch.no_grad()
@pytest.mark.parametrize("greedy", [False, True], ids=["step", "greedy_step"])
def test_a_padded_step_gives_the_trees_own_outputs_and_decodes_losslessly(greedy):
    """A tree through a bucket of its own size and through a larger one: the same logits (greedy: targets and
    drafts), streams and cache, step after step; decoding with it equals plain decoding."""
    from streamfuse.runtime.request.decode import generate
    from streamfuse.runtime.request.emitter import StopRules
    from streamfuse.runtime.request.settings import DecodeSettings

    model, tree = tiny_model(), TreeSpec(((0,), (1,), (0, 0)))
    backends = []
    for buckets in ((tree.num_nodes,), (2, 8)):
        session = EagerRunner(graph_modules(model, GraphShapes(64, 8, buckets), None, ["deferred"] * len(buckets)))
        backends.append(StaticGraphBackend(session, spec_for(model, buckets)))
    own, padded = backends
    for backend in backends:
        backend.reset(64)
        backend.prefill([1, 2, 3], with_streams=False)
    for tokens, path in (([4, 9, 11, 3], [0, 1]), ([7, 7, 2, 5], [0, 1, 3]), ([5, 6, 8, 1], [0])):
        first, second = (b.step(tokens, tree, with_streams=True, greedy=greedy) for b in backends)
        if greedy:
            assert first.greedy_tokens == second.greedy_tokens and len(first.greedy_tokens) == tree.num_nodes
            path = accept(tree, tokens, lambda n: first.greedy_tokens[n]).path
        else:
            torch.testing.assert_close(first.main_logits, second.main_logits, atol=1e-5, rtol=1e-5)
        own.commit(path)
        padded.commit(path)
        width = max(tree.widths)
        assert np.array_equal(first.stream_top(path[-1], width), second.stream_top(path[-1], width))
    torch.testing.assert_close(own.keys[:, :, : own.length], padded.keys[:, :, : padded.length])
    rules = StopRules(max_new_tokens=20)
    for prompt in ([3, 1, 4], [9, 9, 2, 6]):
        plain = generate(padded, prompt, DecodeSettings("ar", rules))
        assert generate(padded, prompt, DecodeSettings("ss", rules, tree=tree)).token_ids == plain.token_ids


# Steps of the 7-node custom tree and the path each commits (then rollback by `back` rows): a path through node 0
# only, one skipping nodes (rows moved down), the deepest branch, a rollback below a pending move, one above it.
ENGINE_STEPS = [([0, 1, 3], 0), ([0, 2, 4, 6], 0), ([0], 0), ([0, 2, 4, 5], 2), ([0, 1], 1)]


@torch.no_grad()
def test_the_engine_keeps_the_cache_as_the_host_would():
    """The span graphs (the engine writes its rows and moves the accepted ones, by the commit input) leave the cache
    the host's copy would, through commits that move rows and rollbacks below and above a pending move."""
    from streamfuse.export.span_attention import span_model

    model, tree = tiny_model(), TREES[2]
    host_shapes, engine_shapes = (GraphShapes(64, 8, (tree.num_nodes,), span=span) for span in (False, True))
    host = StaticGraphBackend(
        EagerRunner(graph_modules(model, host_shapes)), graph_spec(model, host_shapes, ["deferred"])
    )
    span = span_model(model)
    engine = StaticGraphBackend(
        EagerRunner(graph_modules(span, engine_shapes)), graph_spec(span, engine_shapes, ["deferred"])
    )
    assert engine.spec.engine_cache and not host.spec.engine_cache
    rng = np.random.default_rng(0)
    for backend in (host, engine):
        backend.reset(64)
        backend.prefill([5, 9, 14, 3, 77, 41, 8, 8, 60, 2, 33], with_streams=False)
    for path, back in [*ENGINE_STEPS, ([0], 0)]:
        tokens = rng.integers(3, 90, tree.num_nodes).tolist()
        outs = [backend.step(tokens, tree, with_streams=False) for backend in (host, engine)]
        # the engine's call has moved the last commit's rows: both caches hold the same committed rows now
        assert host.length == engine.length
        np.testing.assert_allclose(engine.keys[:, :, : host.length], host.keys[:, :, : host.length], atol=1e-5)
        np.testing.assert_allclose(engine.values[:, :, : host.length], host.values[:, :, : host.length], atol=1e-5)
        np.testing.assert_allclose(outs[1].main_logits, outs[0].main_logits, atol=1e-4)
        for backend in (host, engine):
            backend.commit(path)
            backend.rollback(backend.length - back)
