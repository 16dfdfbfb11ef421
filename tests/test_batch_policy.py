"""The batch policy (runtime/request/batch_policy.py) as a table: what it measures first, when it runs a batch's greedy
speculative sequences as plain rows, and that a shape's first step (its warm-up) and a stale measurement count
as unknown."""

import pytest

from streamfuse.runtime.request.batch_policy import PlainRowsPolicy

# (steps observed so far as (sequences, plain, seconds, tokens), sequences asked about) -> plain rows?
CASES = [
    ([], 1, False),  # a lone sequence: its method decides
    ([], 4, False),  # nothing known: measure speculative steps first
    ([(4, False, 9.0, 7)], 4, False),  # that was its warm-up: measure again
    ([(4, False, 9.0, 7), (4, False, 0.058, 7)], 4, True),  # plain steps at 4 not measured yet
    ([(4, False, 9.0, 7), (4, False, 0.058, 7)], 2, False),  # nothing known at 2
    ([(4, False, 9.0, 7), (4, False, 0.058, 7), (4, True, 5.0, 4), (4, True, 0.019, 4)], 4, True),  # 4/.019 > 7/.058
    ([(4, False, 9.0, 16), (4, False, 0.058, 16), (4, True, 5.0, 4), (4, True, 0.019, 4)], 4, False),  # 16/.058 wins
    ([(4, False, 9.0, 7), (4, False, 0.058, 7), (4, True, 5.0, 4), (4, True, 0.040, 4)], 4, False),  # 4/.040 < 7/.058
]


@pytest.mark.parametrize("observed, sequences, plain", CASES)
def test_the_policy_picks_plain_rows_where_they_make_more_tokens_per_second(observed, sequences, plain):
    policy = PlainRowsPolicy()
    for step in observed:
        policy.observe(*step)
    assert policy.plain_rows(sequences) is plain


def test_the_running_means_weigh_the_newest_step():
    policy = PlainRowsPolicy(weight=0.5)
    for seconds, tokens in ((1.0, 4), (0.04, 8), (0.02, 4)):
        policy.observe(2, False, seconds, tokens)
    assert policy.seconds[(2, False)] == pytest.approx(0.03)  # the warm-up's 1.0 left out
    assert policy.rate == pytest.approx(2.5)  # tokens per sequence: 4/2 -> 8/2 -> 4/2, the warm-up's counted
    assert policy.counts == {(2, False): 3}


def test_a_mode_not_measured_for_refresh_steps_is_measured_again():
    policy = PlainRowsPolicy(refresh=3)
    for held, seconds in ((False, 1.0), (False, 0.05), (True, 1.0), (True, 0.01)):
        policy.observe(4, held, seconds, 4 if held else 6)
    assert policy.plain_rows(4)  # plain: 4 / 0.01 beats 1.5 x 4 / 0.05
    policy.observe(4, True, 0.01, 4)
    assert not policy.plain_rows(4)  # the speculative measurement is 3 steps old: measure it again
    policy.observe(4, False, 0.05, 6)
    assert policy.plain_rows(4)


@pytest.mark.parametrize("weight, refresh", [(0.0, 64), (1.5, 64), (0.25, 0)])
def test_bad_settings_say_so(weight, refresh):
    with pytest.raises(ValueError, match="need 0 < weight <= 1 and refresh >= 1"):
        PlainRowsPolicy(weight=weight, refresh=refresh)
