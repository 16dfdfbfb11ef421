"""Acceptance model, greedy tree construction and the per-device choice, as literal tables."""

import pytest

from streamfuse.runtime.speculation.calibration import AcceptanceModel, BackendCalibration, Timings, TreeCost, calibrate
from streamfuse.runtime.speculation.tree import TreeSpec

# Two answers. Per position: the rank of the true token in stream 1, 2, 3 (a rank >= 4 or -1 is a miss,
# which ends the path), and lookup's matching tokens (-1: it proposed none).
ANSWERS = [
    ([[0, 0, 0], [0, 5, -1], [0, 7, 1], [0, -1, -1], [1, 4, 0], [6, 0, 0]], [-1, -1, -1, -1, 0, 3]),
    ([[0, 1, 5], [9, 0, 0], [0, 8, -1], [4, -1, -1]], [2, -1, 1, -1]),
]
MODEL = AcceptanceModel.from_answers(ANSWERS, max_rank=4, depth=3)
CHAIN = TreeSpec.chain(3)

# tree -> expected tokens per step, replaying decoding along each answer by hand (tokens / steps):
EXPECTED = [
    # first answer: 2 + 2 (positions 0, 2) + 1 + 1; second: 2 + 2 (positions 0, 2)
    (TreeSpec(((0,),)), (6 + 4) / (4 + 2)),
    # first: 4 (position 0: all three streams right) + 1 + 1; second: 2 + 2
    (CHAIN, (6 + 4) / (3 + 2)),
    # first: 4 + 1 (lookup proposes, wrongly; stream 1's rank 1 is not held) + 4 (lookup 3 right); second: 3 + 1
    (CHAIN.with_lookup(3), (9 + 4) / (3 + 2)),
    # first: 2 + 2 + 2 (position 4: stream 1's rank 1); second: 2 (stream rank 0, or lookup's first) + 2
    (TreeSpec(((0,), (1,))).with_lookup(1), (6 + 4) / (3 + 2)),
    (TreeSpec(((0,), (0, 1))), (6 + 4) / (4 + 2)),  # second: 3 (position 0: ranks 0 then 1) + 1
]


def test_rows_keep_each_path_up_to_its_first_miss():
    assert MODEL.answers == (
        (((0, 0, 0), -1), ((0,), -1), ((0,), -1), ((0,), -1), ((1,), 0), ((), 3)),
        (((0, 1), 2), ((), -1), ((0,), 1), ((), -1)),
    )
    assert MODEL.positions == 10
    assert AcceptanceModel.from_dict(MODEL.to_dict()) == MODEL


@pytest.mark.parametrize("tree, tokens", EXPECTED)
def test_expected_tokens_replay_decoding_along_each_answer(tree, tokens):
    assert MODEL.expected_tokens(tree) == pytest.approx(tokens)


def test_path_probabilities_and_nested_greedy_trees():
    assert MODEL.path_probabilities() == pytest.approx({(0,): 0.6, (0, 0): 0.1, (0, 0, 0): 0.1, (0, 1): 0.1, (1,): 0.1})
    trees = [tree.paths for tree in MODEL.stream_trees(max_nodes=16)]
    # the most probable paths first; ties go to the shallower path, so every prefix is present
    assert trees == [
        ((0,),),
        ((0,), (1,)),
        ((0,), (1,), (0, 0)),
        ((0,), (1,), (0, 0), (0, 1)),
        ((0,), (1,), (0, 0), (0, 1), (0, 0, 0)),
    ]
    assert len(MODEL.stream_trees(max_nodes=3)) == 2


def test_best_tree_per_size_weighs_a_lookup_branch_against_more_stream_nodes():
    best = MODEL.best_trees(max_nodes=7)
    assert sorted(best) == [2, 3, 4, 5, 6, 7]
    assert best[2] == TreeSpec(((0,),))
    # stream 1's second rank (2.0 tokens) beats a lookup node in its place (11 tokens in 6 steps: at position 4
    # lookup proposes wrongly, so the node no longer holds stream 1's rank 1, which was right)
    assert best[3] == TreeSpec(((0,), (1,))) and MODEL.expected_tokens(best[3]) == pytest.approx(2.0)
    assert MODEL.expected_tokens(TreeSpec(((0,),)).with_lookup(1)) == pytest.approx(11 / 6)
    assert all(
        MODEL.expected_tokens(best[n]) >= MODEL.expected_tokens(tree)
        for tree in MODEL.stream_trees(7)
        for n in [tree.num_nodes]
    )


@pytest.mark.parametrize("chain_ms, choice", [(20.0, CHAIN), (40.0, CHAIN.with_lookup(3))])
def test_the_choice_is_expected_tokens_over_measured_cost(chain_ms, choice):
    # plain 10 ms; the chain yields 2.0 tokens per step, the lookup tree 2.6 at 30 ms (0.87x)
    steps = {CHAIN: [chain_ms / 1e3, 1.0, chain_ms / 1e3], CHAIN.with_lookup(3): [0.03]}
    realised = {CHAIN: 1.9, CHAIN.with_lookup(3): 2.4}  # what the timed runs got: shown, not what chooses
    timings = Timings([0.01, 0.01, 5.0], steps, realised, prefill=[0.002, 0.004, 0.002], prompt_tokens=250.0)
    calibration = calibrate(MODEL, timings, "test cpu", threads=2)  # medians: outliers ignored
    assert calibration.tree == choice
    assert calibration.step_cost(CHAIN) == pytest.approx(chain_ms / 10)
    assert calibration.step_cost(TreeSpec.chain(1)) is None
    again = BackendCalibration.from_dict(calibration.to_dict())
    assert again.tree == choice and again.plain_seconds == pytest.approx(0.01)
    assert [cost.realised_tokens for cost in again.trees] == [1.9, 2.4]
    assert again.prefill_seconds_per_token == pytest.approx(0.002) and again.prompt_tokens == 250.0
    # a request of 250 prompt tokens and 61 new ones: 0.5 s of prefill, then 60 tokens at the chosen tree's rate
    best = calibration.best
    assert calibration.request_seconds(61) == pytest.approx(0.5 + 60 / best.expected_tokens * best.step_seconds)
    assert calibration.to_dict()["expected_speedup"] == pytest.approx(max(2.0 * 10 / chain_ms, 2.6 / 3), abs=1e-4)


# A tree's greedy steps timed as its greedy_step graph (one call) and, where it has one, as a step then a streams
# call (two calls; None: not timed) -> (two calls chosen, the step's ms, the slower way's ms).
WAYS = [
    ([0.020, 0.021, 0.019], None, (False, 20.0, None)),
    ([0.020, 0.021, 0.019], [0.018, 0.030, 0.017], (True, 18.0, 20.0)),
    ([0.020, 0.021, 0.019], [0.022, 0.020, 0.025], (False, 20.0, 22.0)),
    ([0.020], [0.020], (False, 20.0, 20.0)),  # a tie keeps the one call
]


@pytest.mark.parametrize("one, two, expected", WAYS)
def test_a_tree_takes_the_faster_of_the_ways_its_greedy_steps_were_timed(one, two, expected):
    timings = Timings([0.01], {CHAIN: one}, {CHAIN: 2.0}, [0.002], 100.0, {CHAIN: two} if two else {})
    calibration = calibrate(MODEL, timings, "test cpu", threads=2)
    (cost,) = calibration.trees
    other = None if cost.other_seconds is None else round(1e3 * cost.other_seconds, 6)
    assert (cost.two_calls, round(1e3 * cost.step_seconds, 6), other) == expected
    assert calibration.step_cost(CHAIN) == pytest.approx(expected[1] / 10)
    assert calibration.two_call_trees() == ((CHAIN,) if expected[0] else ())
    assert BackendCalibration.from_dict(calibration.to_dict()) == calibration


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="no answer positions"):
        AcceptanceModel.from_answers([([], [])], 4, 3)
    with pytest.raises(ValueError, match="timed plain steps"):
        calibrate(MODEL, Timings([], {CHAIN: [0.1]}, {CHAIN: 1.0}, [0.001], 10.0), "cpu", 1)
    assert TreeCost(CHAIN, 0.02, 2.4, 2.0).speedup(0.01) == pytest.approx(1.2)
