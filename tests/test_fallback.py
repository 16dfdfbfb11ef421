"""Automatic fallback: plain decoding where speculation does not pay, same tokens either way."""

import pytest
import torch

from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.runtime.speculation.fallback import Fallback, FallbackConfig
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from test_decode import OracleDrafts, backend_for

# (tokens of each speculative step, in order) -> the step after which the switch goes plain (or None).
# step_cost 1.5, probe 2 steps, block 3: a probe pays with >= 3 tokens, a block with >= 4.5.
SWITCHES = [
    ([2, 1], None),  # the first probe: 3 tokens in 2 steps pays
    ([1, 1], 2),  # 2 < 3: plain after the second step
    ([2, 1, 1, 1, 1], 5),  # probe passes, then the first block of 3 (3 tokens < 4.5) fails
    ([2, 2, 2, 1, 2], None),  # the block after the probe has 5 >= 4.5
]


@pytest.mark.parametrize("tokens, fails_at", SWITCHES)
def test_the_switch_judges_probes_then_blocks(tokens, fails_at):
    switch = Fallback(FallbackConfig(step_cost=1.5, block=3, probe=2, pause=4))
    failed = [i + 1 for i, t in enumerate(tokens) if switch.after_step(t) is not None]
    assert failed == ([fails_at] if fails_at else [])
    assert switch.speculating == (fails_at is None)


# (each step's tokens and its tree's cost) -> the step after which the switch goes plain (or None): a
# method whose tree changes per step (ss-adaptive) pays when its tokens cover the sum of its steps' costs.
MIXED = [
    ([(2, 1.2), (1, 1.9)], 2),  # 3 tokens < 3.1 plain steps of cost
    ([(2, 1.2), (1, 1.6)], None),  # 3 >= 2.8
    ([(3, 1.0), (1, 2.0), (1, 1.2), (1, 1.2), (2, 1.8)], 5),  # the probe pays; the block's 4 < 4.2 fails
]


@pytest.mark.parametrize("steps, fails_at", MIXED)
def test_steps_of_different_trees_are_judged_at_their_own_costs(steps, fails_at):
    switch = Fallback(FallbackConfig(step_cost=1.5, block=3, probe=2, pause=4, tree_costs=(("a", 1.2),)))
    failed = [i + 1 for i, (tokens, cost) in enumerate(steps) if switch.after_step(tokens, cost) is not None]
    assert failed == ([fails_at] if fails_at else [])
    assert switch.config.cost("a") == 1.2 and switch.config.cost("unknown") == 1.5  # the default tree's


def test_plain_stretches_double_after_each_failed_probe_and_reset_after_one_that_pays():
    switch = Fallback(FallbackConfig(step_cost=1.5, block=3, probe=2, pause=4, max_pause=8))
    stretches = []
    for probe in ([1, 1], [1, 1], [1, 1], [3, 3], [1, 1, 1]):  # fail, fail, fail, pay, fail (a block)
        assert switch.speculating
        for tokens in probe:
            switch.after_step(tokens)
        plain = 0
        while not switch.speculating:
            assert switch.last_plain_token == (switch.plain_left == 1)
            switch.after_plain_token()
            plain += 1
        stretches.append(plain)
    assert stretches == [4, 8, 8, 0, 4]  # doubled up to max_pause; a probe that pays resets it


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"step_cost": 0.0}, "step_cost must be > 0"),
        ({"step_cost": 1.2, "block": 0}, "block and probe must be >= 1"),
        ({"step_cost": 1.2, "pause": 0}, "pause must be in"),
        ({"step_cost": 1.2, "pause": 600}, "pause must be in"),
        ({"step_cost": 1.2, "tree_costs": (("a", 0.0),)}, "tree_costs must be > 0"),
    ],
)
def test_bad_fallback_settings_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        FallbackConfig(**fields)


def modelled_cost(run, step_cost: float) -> float:
    """The run's time in plain decoding steps: prefill and plain calls 1, speculative steps step_cost."""
    return 1 + run.plain_calls + step_cost * len(run.steps)


@pytest.mark.parametrize("schedule", ["fused", "deferred"])
def test_useless_drafts_fall_back_to_within_five_percent_of_plain(schedule):
    backend = backend_for(3, schedule=schedule)
    rules = StopRules(max_new_tokens=160)
    prompt = [3, 1, 4, 1, 5]
    plain = generate(backend, prompt, DecodeSettings("ar", rules))
    useless = OracleDrafts(backend, plain.token_ids, noise=1.0, seed=0)  # random drafts, never the oracle
    config = FallbackConfig(step_cost=1.4)
    trace = Trace()
    fast = generate(useless, prompt, DecodeSettings("ss", rules, tree=TreeSpec.chain(3), fallback=config), trace=trace)
    without = generate(useless, prompt, DecodeSettings("ss", rules, tree=TreeSpec.chain(3)))
    assert fast.token_ids == plain.token_ids == without.token_ids
    run = trace.runs[0]
    assert modelled_cost(run, config.step_cost) <= 1.05 * plain.run.model_calls
    assert modelled_cost(without.run, config.step_cost) > 1.3 * plain.run.model_calls  # what it saves
    assert [s.to for s in run.switches][:2] == ["plain", "ss"] and run.switches[0].tokens_per_step < 1.4
    assert run.model_calls == 1 + len(run.steps) + run.plain_calls


def test_oracle_drafts_never_switch_off():
    backend = backend_for(4)
    rules = StopRules(max_new_tokens=120)
    plain = generate(backend, [2, 7], DecodeSettings("ar", rules))
    trace = Trace()
    settings = DecodeSettings("ss", rules, tree=TreeSpec.chain(3), fallback=FallbackConfig(step_cost=1.4))
    fast = generate(OracleDrafts(backend, plain.token_ids, 0.0, 0), [2, 7], settings, trace=trace)
    assert fast.token_ids == plain.token_ids
    assert trace.runs[0].switches == [] and trace.runs[0].plain_calls == 0
    assert fast.run.model_calls <= plain.run.model_calls / 3.5


def test_sampling_through_switches_matches_plain_sampling_token_for_token():
    backend = backend_for(5)
    rules = StopRules(max_new_tokens=100)
    sampling = SamplingConfig(temperature=0.9, top_k=20)
    for seed in range(3):
        plain = generate(backend, [4, 5, 6], DecodeSettings("ar", rules, sampling=sampling, seed=seed))
        drafter = OracleDrafts(backend, plain.token_ids, 0.7, seed)  # some steps pay, some do not
        trace = Trace()
        settings = DecodeSettings(
            "ss",
            rules,
            tree=TreeSpec.full(3, 2),
            sampling=sampling,
            seed=seed,
            fallback=FallbackConfig(step_cost=2.0, block=2, probe=1, pause=3),
        )
        fast = generate(drafter, [4, 5, 6], settings, trace=trace)
        assert fast.token_ids == plain.token_ids
        assert trace.runs[0].switches  # the run did switch


def test_switches_reach_the_profile(tmp_path):
    from streamfuse.runtime.measure.trace_profile import profile_files

    backend = backend_for(3)
    rules = StopRules(max_new_tokens=80)
    trace = Trace(method="ss")
    plain = generate(backend, [1, 2], DecodeSettings("ar", rules))
    settings = DecodeSettings("ss", rules, tree=TreeSpec.chain(3), fallback=FallbackConfig(step_cost=1.4))
    generate(OracleDrafts(backend, plain.token_ids, 1.0, 0), [1, 2], settings, trace=trace)
    trace.save(tmp_path / "trace.json")
    metrics = profile_files(tmp_path / "trace.json")
    run = trace.runs[0]
    assert metrics["plain_calls"] == run.plain_calls > 0
    assert metrics["switches_to_plain"] == sum(s.to == "plain" for s in run.switches) >= 1
    assert metrics["call_reduction"] == pytest.approx(run.new_tokens / run.model_calls)
    assert torch.isfinite(torch.tensor(metrics["forward_latency_s"]))
