"""Method ss-adaptive: an acceptance head on the streams' states picks each step's tree; the output stays
plain decoding's."""

import pytest
import torch

from streamfuse.adapters.acceptance import AcceptanceHead
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.methods.ss_adaptive.drafter import AdaptiveStreamDrafter
from streamfuse.methods.ss_adaptive.train import item_features
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.runtime.speculation.acceptance_head import AcceptancePredictor
from streamfuse.runtime.speculation.calibration import AcceptanceModel, BackendCalibration, TreeCost
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.runtime.speculation.tree_choice import TreeChoice, lookup_gain, top_probabilities
from streamfuse.training.data import Encoded, collate
from streamfuse.training.loss import stream_targets
from streamfuse.training.train import forward_batch

from test_decode import backend_for, chi_square_p, exact_joint
from test_specdec import constant_head

# Four positions: ranks (0, 0), (0,), (1,), none. P(0) = 1/2, P(0, 0) = 1/4, P(1) = 1/4: p_1 = p_2 = 1/2.
ACCEPTANCE = AcceptanceModel(4, 2, ((((0, 0), -1), ((0,), -1), ((1,), -1), ((), -1)),))
CHAIN_1, CHAIN_2, WIDE = TreeSpec.chain(1), TreeSpec.chain(2), TreeSpec(((0,), (1,)))
COSTS = {CHAIN_1: 1.2, CHAIN_2: 1.5, WIDE: 1.3}  # plain steps


def choice(trees=(CHAIN_1, CHAIN_2, WIDE), acceptance=ACCEPTANCE) -> TreeChoice:
    calibration = BackendCalibration(
        "test", 1, 1.0, tuple(TreeCost(t, COSTS.get(t, 1.4), 1.0, 1.0) for t in trees), 0.001, 10.0
    )
    return TreeChoice.from_calibration(acceptance, calibration)


def test_top_probabilities_are_the_conditional_chances_of_each_depths_top_token():
    assert top_probabilities(ACCEPTANCE.path_probabilities(), 2) == (0.5, 0.5)
    assert top_probabilities({(0,): 0.8, (0, 0): 0.2}, 3) == (0.8, 0.25, 0.0)


# (tree, predicted q_1, q_2) -> expected tokens. The tilt keeps the calibration at its own rates, puts all
# of a depth's mass on the top token at q = 1 and on the other ranks (rescaled) at q = 0.
EXPECTED = [
    (CHAIN_2, (0.5, 0.5), 1.75),  # 1 + P(0) + P(0, 0): the calibration's own
    (CHAIN_2, (1.0, 1.0), 3.0),
    (CHAIN_2, (0.0, 0.0), 1.0),
    (CHAIN_2, (0.9, 0.1), 1.99),  # 1 + 0.9 + 0.9 * 0.1
    (WIDE, (0.5, 0.5), 1.75),
    (WIDE, (0.0, 0.5), 1.5),  # rank 1 takes the miss mass: 1/4 * (1 - 0) / (1 - 1/2)
    (WIDE, (1.0, 0.5), 2.0),
]


@pytest.mark.parametrize("tree, predicted, tokens", EXPECTED)
def test_expected_tokens_tilt_the_calibration_by_the_prediction(tree, predicted, tokens):
    options = choice()
    candidate = next(c for c in options.candidates if c.tree == tree)
    assert options.expected_tokens(candidate, predicted) == pytest.approx(tokens)


# (q_1, q_2) -> the tree with most expected tokens per plain step of cost (COSTS).
CHOICES = [
    ((1.0, 1.0), CHAIN_2),  # 3 / 1.5 beats 2 / 1.2 and 2 / 1.3
    ((0.0, 0.0), WIDE),  # only rank 1 can be accepted: 1.5 / 1.3
    ((0.9, 0.1), CHAIN_1),  # 1.9 / 1.2 beats 1.95 / 1.3 and 1.99 / 1.5
]


@pytest.mark.parametrize("predicted, tree", CHOICES)
def test_the_choice_maximises_expected_tokens_per_cost(predicted, tree):
    assert choice().choose(predicted) == tree


def test_an_expensive_tree_is_not_chosen_even_when_it_promises_most():
    COSTS[CHAIN_2] = 3.1
    try:
        assert choice().choose((1.0, 1.0)) == CHAIN_1  # 2 / 1.2 beats 3 / 3.1
    finally:
        COSTS[CHAIN_2] = 1.5


def test_lookup_gain_is_the_branch_extra_over_the_same_stream_tree():
    # Lookup proposes nothing (-1): the branch keeps its stream rank, gain 0; lookup right where the streams
    # miss: +1; lookup wrong where rank 1 would have been right: 0 (the branch replaced rank 1's token).
    acceptance = AcceptanceModel(4, 1, ((((0,), -1), ((), 1), ((1,), 0)),))
    tree = TreeSpec(((0,), (1,)), lookup=(1,))
    assert lookup_gain(acceptance, tree) == pytest.approx(1 / 3)
    assert lookup_gain(acceptance, TreeSpec(((0,), (1,)))) == 0.0
    options = choice((tree,), acceptance)
    # The branch's node is left out of the tilt (p_1 = 1/3, tilted to q_1 = 1/2) and adds its mean gain.
    assert options.expected_tokens(options.candidates[0], (0.5,)) == pytest.approx(1 + 0.5 + 1 / 3)


def test_candidates_are_the_calibrated_stream_trees_the_backend_runs():
    deep = TreeSpec.chain(3)  # deeper than the acceptance model's two streams: a draft-model chain
    calibration = BackendCalibration(
        "test", 1, 1.0, tuple(TreeCost(t, 1.5, 1.0, 1.0) for t in (CHAIN_1, CHAIN_2, WIDE, deep)), 0.001, 10.0
    )
    picked = TreeChoice.from_calibration(ACCEPTANCE, calibration, lambda tree: tree != WIDE, max_nodes=2)
    assert [c.tree for c in picked.candidates] == [CHAIN_1] and picked.largest == CHAIN_1
    with pytest.raises(ValueError, match="no calibrated tree runs on this backend"):
        TreeChoice.from_calibration(ACCEPTANCE, calibration, lambda tree: False)


def random_head(seed: int, hidden: int = 32) -> AcceptancePredictor:
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden, depth=1)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.5)
    return AcceptancePredictor(head.state_dict())


TREES3 = (TreeSpec.chain(1), TreeSpec.chain(3), TreeSpec.full(3, 2), TreeSpec(((0,), (1,), (0, 0))).with_lookup(1))
ACCEPTANCE3 = AcceptanceModel(4, 3, ((((0, 0, 0), 1), ((0,), -1), ((1, 0), 0), ((), 2), ((0, 1), -1)),))


def adaptive(backend, head, trees=TREES3, costs=(1.1, 1.4, 1.9, 1.5)) -> AdaptiveStreamDrafter:
    calibration = BackendCalibration(
        "test", 1, 1.0, tuple(TreeCost(t, c, 1.0, 1.0) for t, c in zip(trees, costs)), 0.001, 10.0
    )
    return AdaptiveStreamDrafter(TreeChoice.from_calibration(ACCEPTANCE3, calibration), head, backend.num_streams)


@pytest.mark.parametrize("schedule", ["fused", "deferred"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_ss_adaptive_equals_plain_greedy_with_trees_changing_step_by_step(seed, schedule):
    backend = backend_for(seed, schedule=schedule)
    rules = StopRules(max_new_tokens=40)
    drafter = adaptive(backend, random_head(seed))
    settings = DecodeSettings("ss-adaptive", rules, tree=drafter.tree)
    trace = Trace()
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]):
        fast = generate(backend, prompt, settings, drafter=drafter, trace=trace)
        assert fast.token_ids == generate(backend, prompt, DecodeSettings("ar", rules)).token_ids
    assert len({step.tree_nodes for run in trace.runs for step in run.steps}) >= 2


@torch.no_grad()
def test_greedy_ss_adaptive_on_static_graphs_switches_between_narrow_and_wide_trees():
    """greedy_step drafts as many ranks as the widest tree its largest bucket holds, so a step after the 1-wide
    chain may take the 2-wide tree; every step one greedy_step call, outputs plain decoding's."""
    from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec
    from streamfuse.export.verify import EagerRunner
    from streamfuse.runtime.backends.static_graph import StaticGraphBackend

    model = backend_for(1).model
    trees = (TreeSpec.chain(3), TreeSpec.full(3, 2))
    shapes = GraphShapes(capacity=96, prefill_chunk=8, buckets=(4, 15))
    graphs = StaticGraphBackend(
        EagerRunner(graph_modules(model, shapes, None, ["deferred"] * 2)), graph_spec(model, shapes, ["deferred"] * 2)
    )
    rules, trace = StopRules(max_new_tokens=40), Trace()
    drafter = adaptive(graphs, random_head(1), trees, (1.3, 1.6))
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [7, 7, 21]):
        fast = generate(
            graphs, prompt, DecodeSettings("ss-adaptive", rules, tree=drafter.tree), drafter=drafter, trace=trace
        )
        assert fast.token_ids == generate(graphs, prompt, DecodeSettings("ar", rules)).token_ids
    chosen = [step.tree_nodes for run in trace.runs for step in run.steps]
    assert any(a == 4 and b == 15 for a, b in zip(chosen, chosen[1:]))  # the chain, then the wide tree


@pytest.mark.parametrize("probability, nodes", [(1.0, 4), (1e-9, 5)])
def test_a_confident_head_drafts_the_deep_chain_and_a_doubtful_one_the_lookup_tree(probability, nodes):
    """Costs 1.1 / 1.4 / 1.9 / 1.5: certain acceptance pays 4 / 1.4 with the 3-chain; where every top token
    is rejected, rank 1 and the lookup branch are left, and the 5-node tree holds both for less than the
    full tree."""
    backend = backend_for(0)
    drafter = adaptive(backend, constant_head(probability))
    settings = DecodeSettings("ss-adaptive", StopRules(10), tree=drafter.tree)
    trace = Trace()
    generate(backend, [3, 1, 4], settings, drafter=drafter, trace=trace)
    assert {step.tree_nodes for step in trace.runs[0].steps} == {nodes}


def test_ss_adaptive_sampling_matches_the_target_distribution_on_torch_and_static_graphs():
    """At T = 1, (x1, x2) over an 8-token vocabulary: chi-square against the exact target, the trees
    chosen per step by a random head, on torch and through eager-run exported graphs. A third token
    makes a second step, whose tree depends on the drawn x1."""
    from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec
    from streamfuse.export.verify import EagerRunner
    from streamfuse.runtime.backends.static_graph import StaticGraphBackend

    torch_target = backend_for(5, vocab=8, gamma=2)
    trees = (TreeSpec.chain(1), TreeSpec.chain(2), TreeSpec.full(2, 2))
    acceptance = AcceptanceModel(4, 2, ((((0, 0), -1), ((1,), -1), ((), -1), ((0, 1), -1)),))
    model, shapes = torch_target.model, GraphShapes(capacity=64, prefill_chunk=8, buckets=(2, 3, 7))
    graphs = StaticGraphBackend(
        EagerRunner(graph_modules(model, shapes, None, ["deferred"] * 3)), graph_spec(model, shapes, ["deferred"] * 3)
    )
    calibration = BackendCalibration(
        "test", 1, 1.0, tuple(TreeCost(t, c, 1.0, 1.0) for t, c in zip(trees, (1.2, 1.3, 2.0))), 0.001, 10.0
    )
    exact = exact_joint(torch_target, SamplingConfig(1.0))
    for target in (torch_target, graphs):
        drafter = AdaptiveStreamDrafter(TreeChoice.from_calibration(acceptance, calibration), random_head(1), 2)
        counts, trace = torch.zeros(8, 8), Trace()
        for seed in range(1000):
            settings = DecodeSettings(
                "ss-adaptive", StopRules(3), tree=drafter.tree, sampling=SamplingConfig(1.0), seed=seed
            )
            tokens = generate(target, [1, 2], settings, drafter=drafter, trace=trace).token_ids
            counts[tokens[0], tokens[1]] += 1
        assert chi_square_p(counts, exact) > 1e-3, target.name
        assert len({step.tree_nodes for run in trace.runs for step in run.steps}) >= 2


@torch.no_grad()
def test_each_example_is_a_stream_state_asked_only_where_the_tops_above_were_accepted():
    backend = backend_for(4, vocab=11)
    model: SpeculativeStreamingLM = backend.model
    # An answer the streams partly predict: the model's own greedy continuation, so acceptance varies.
    prompt = [1, 5, 7, 2]
    answer = generate(backend, prompt, DecodeSettings("ar", StopRules(12))).token_ids
    item = Encoded("own", prompt + answer, len(prompt))
    hidden, accepted = item_features(model, item, pad_id=0)
    batch = collate([item], 0)
    out = forward_batch(model, batch, with_streams=True)
    expected_hidden, expected_labels = [], []
    anchors = len(answer) - 1  # the last anchor's root is the answer's last token: no step follows
    alive = [True] * anchors
    for depth in range(1, 4):
        targets = stream_targets(batch.labels, batch.anchors, batch.anchor_valid, depth)[0]
        for a in range(anchors):
            if alive[a] and targets[a] >= 0:
                state = out.stream_hidden[0, a, depth - 1]
                hit = int(model.logits(state).argmax()) == int(targets[a])
                expected_hidden.append(state)
                expected_labels.append(float(hit))
                alive[a] = hit
            else:
                alive[a] = False
    torch.testing.assert_close(hidden, torch.stack(expected_hidden))
    assert accepted.tolist() == expected_labels
