"""SpecDec++: an acceptance head on the draft model chooses each chain's length; outputs stay plain decoding's."""

import math

import numpy as np
import pytest
import torch

from streamfuse.adapters.acceptance import AcceptanceHead, load_acceptance_head, save_acceptance_head
from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.masks import additive
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.methods.sd.drafter import ModelDrafter
from streamfuse.methods.specdec.drafter import StopRule
from streamfuse.methods.specdec.train import branch_inputs, item_features
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.runtime.speculation.acceptance_head import AcceptancePredictor, load_acceptance_predictor
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.acceptance import AcceptanceFeatures, AcceptanceTraining, train_acceptance, weighted_bce
from streamfuse.training.data import Encoded

from conftest import make_tiny_llama
from test_decode import backend_for, chi_square_p, exact_joint


def constant_head(probability: float) -> AcceptancePredictor:
    """A head that predicts `probability` everywhere (logit clipped to +-40: exactly 1.0 / ~0 in float32)."""
    head = AcceptanceHead(32, depth=0)
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(
            max(-40.0, min(40.0, math.log(probability / (1 - probability))))
            if 0 < probability < 1
            else (40.0 if probability else -40.0)
        )
    return AcceptancePredictor(head.state_dict())


def specdec(target, engine, prompt, settings, stop, trace=None):
    return generate(target, prompt, settings, drafter=ModelDrafter(engine, settings, stop), trace=trace)


# (predicted acceptance, threshold h, γ_max) -> drafts per chain. After k fed drafts P(a rejection) is
# 1 - p^k; the first k where it passes h ends the chain with the draft that call proposed: k + 1 drafts.
LENGTHS = [
    (1.0, 0.5, 6, 6),  # never a predicted rejection: always γ_max
    (0.0, 0.5, 6, 2),  # a rejection is certain after the first: the shortest chain, 2
    (0.8, 0.5, 8, 5),  # 1 - 0.8^4 = 0.59 is the first past 0.5
    (0.9, 0.3, 8, 5),  # 1 - 0.9^4 = 0.34 is the first past 0.3
    (0.5, 0.4, 3, 2),
    (0.5, 0.6, 3, 3),  # 1 - 0.5^2 = 0.75 passes, but γ_max = 3 is reached first
]


@pytest.mark.parametrize("probability, threshold, gamma, drafts", LENGTHS)
def test_chain_length_follows_the_predicted_rejection_probability(probability, threshold, gamma, drafts):
    target, engine = backend_for(1), backend_for(3)
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    settings = DecodeSettings("specdec++", rules, tree=TreeSpec.chain(gamma))
    trace = Trace()
    fast = specdec(target, engine, [4, 8, 15], settings, StopRule(constant_head(probability), threshold), trace)
    assert fast.token_ids == generate(target, [4, 8, 15], DecodeSettings("ar", rules)).token_ids
    run = trace.runs[0]
    assert run.method == "specdec++" and {step.tree_nodes for step in run.steps} == {drafts + 1}
    assert all(step.draft_calls >= drafts for step in run.steps)  # one call per draft but the last, + pending


@pytest.mark.parametrize("threshold", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_greedy_specdec_equals_plain_greedy_with_a_trained_looking_head(threshold):
    """A random head (depth 2): lengths vary step by step, outputs do not."""
    target, engine = backend_for(2), backend_for(2)  # the target as its own draft model: long chains get accepted
    torch.manual_seed(7)
    head = AcceptanceHead(32, depth=2)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.5)
    rules = StopRules(max_new_tokens=40)
    settings = DecodeSettings("specdec++", rules, tree=TreeSpec.chain(6))
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6]):
        trace = Trace()
        fast = specdec(
            target, engine, prompt, settings, StopRule(AcceptancePredictor(head.state_dict()), threshold), trace
        )
        assert fast.token_ids == generate(target, prompt, DecodeSettings("ar", rules)).token_ids
        lengths = [step.tree_nodes - 1 for step in trace.runs[0].steps]
        assert all(2 <= n <= 6 for n in lengths)
        if threshold == 1.0:
            assert set(lengths) == {6}


def test_specdec_sampling_matches_the_target_distribution():
    """Chains of varying length still go through speculative sampling: 1500 draws of (x1, x2) over 8 tokens,
    chi-square against the exact target."""
    target, engine = backend_for(5, vocab=8, gamma=2), backend_for(9, vocab=8, gamma=2)
    stop = StopRule(constant_head(0.7), 0.5)  # 2 or 3 drafts
    counts = torch.zeros(8, 8)
    for seed in range(1500):
        settings = DecodeSettings(
            "specdec++", StopRules(2), tree=TreeSpec.chain(3), sampling=SamplingConfig(1.0), seed=seed
        )
        tokens = specdec(target, engine, [1, 2], settings, stop).token_ids
        counts[tokens[0], tokens[1]] += 1
    assert chi_square_p(counts, exact_joint(target, SamplingConfig(1.0))) > 1e-3


# branch_inputs: the sequence, then one branch token per rejected position t, at position t, seeing ids[:t] and itself.
BRANCHES = [
    ([7, 8, 9], {}, [7, 8, 9], [0, 1, 2], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    (
        [7, 8, 9],
        {1: 5, 2: 6},
        [7, 8, 9, 5, 6],
        [0, 1, 2, 1, 2],
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]],
    ),
]


@pytest.mark.parametrize("ids, drafts, tokens, positions, visible", BRANCHES)
def test_branch_inputs(ids, drafts, tokens, positions, visible):
    got_tokens, got_positions, got_visible = branch_inputs(ids, drafts)
    assert (got_tokens, got_positions, got_visible.int().tolist()) == (tokens, positions, visible)


def draft_lm(seed: int) -> SpeculativeStreamingLM:
    return SpeculativeStreamingLM(make_tiny_llama(seed, layers=2), StreamConfig(1, 1)).eval()


@torch.no_grad()
def last_state(model, ids):
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], additive(causal[None, None])).hidden[0, -1]


@torch.no_grad()
def test_each_example_is_the_draft_state_at_its_own_token_in_the_targets_context():
    """Checked against the definition, one causal pass per example: the draft's argmax d_t after
    ids[:t], label d_t == ids[t], and the state over ids[:t] + [d_t] at d_t."""
    model = draft_lm(4)
    prompt = [3, 14, 15, 9]
    answer = [int(model.logits(last_state(model, prompt)).argmax())]
    while len(answer) < 12:  # the draft's own greedy answer, with two tokens changed: both labels occur
        answer.append(int(model.logits(last_state(model, prompt + answer)).argmax()))
    answer[4], answer[8] = (answer[4] + 1) % 97, (answer[8] + 2) % 97
    ids = prompt + answer
    hidden, accepted = item_features(model, Encoded("a", ids, len(prompt)))
    assert hidden.shape == (len(answer) - 1, 32) and 0 < accepted.sum() < len(accepted)
    for row, t in enumerate(range(len(prompt) + 1, len(ids))):
        drafted = int(model.logits(last_state(model, ids[:t])).argmax())
        assert accepted[row] == float(drafted == ids[t])
        torch.testing.assert_close(hidden[row], last_state(model, ids[:t] + [drafted]), atol=1e-5, rtol=1e-5)


def test_weighted_bce_weighs_rejections():
    logits, labels = torch.zeros(2), torch.tensor([1.0, 0.0])
    assert float(weighted_bce(logits, labels, 6.0)) == pytest.approx(math.log(2) * 7 / 2)
    assert float(weighted_bce(logits, labels, 1.0)) == pytest.approx(math.log(2))


def trained(features, reject_weight):
    torch.manual_seed(0)
    head = AcceptanceHead(32, depth=1)
    config = AcceptanceTraining(epochs=8, batch=128, learning_rate=1e-2, reject_weight=reject_weight)
    return head, train_acceptance(head, features, config)


def test_training_separates_accepted_from_rejected_drafts_and_survives_a_save(tmp_path):
    """Separable examples: the head learns them; weighing rejections more lowers every prediction
    (the paper's w_rej: stop earlier); saved and loaded, it predicts the same."""
    hidden = torch.randn(2048, 32, generator=torch.Generator().manual_seed(0))
    features = AcceptanceFeatures(hidden.half(), (hidden[:, 0] > 0).float())
    head, even = trained(features, 1.0)
    assert even["acceptance_rate"] == pytest.approx(float(features.accepted.mean()), abs=1e-4)
    assert even["predicted_if_accepted"] > 0.85 and even["predicted_if_rejected"] < 0.15
    _, weighted = trained(features, 6.0)
    assert weighted["predicted_if_accepted"] < even["predicted_if_accepted"] - 0.05
    assert weighted["predicted_if_rejected"] < even["predicted_if_rejected"]
    save_acceptance_head(head, tmp_path, {"training_key": "k"})
    loaded = load_acceptance_head(tmp_path)
    assert torch.equal(loaded(hidden[:5]), head(hidden[:5]).detach())
    on_host = load_acceptance_predictor(tmp_path, "specdec")  # the runtime's numpy reader of the same files
    np.testing.assert_allclose(
        on_host.logits(hidden[:64].numpy()), head(hidden[:64]).detach().numpy(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(method="specdec++", tree=TreeSpec.full(2, 2)), "drafts a chain"),
        (dict(method="sd", tree=TreeSpec.chain(3), threshold=0.3), "SpecDec\\+\\+'s, not method sd's"),
    ],
)
def test_settings_refuse_what_specdec_cannot_do(settings, message):
    with pytest.raises(ValueError, match=message):
        DecodeSettings(rules=StopRules(4), **settings)


def test_a_threshold_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="probability in \\[0, 1\\]"):
        StopRule(constant_head(0.5), 1.5)


def test_a_drafter_with_a_stop_rule_drafts_for_specdec_only():
    with pytest.raises(ValueError, match="drafts for method specdec\\+\\+, not 'sd'"):
        ModelDrafter(
            backend_for(0),
            DecodeSettings("sd", StopRules(4), tree=TreeSpec.chain(3)),
            StopRule(constant_head(0.5), 0.5),
        )


@torch.no_grad()
def test_draft_model_methods_sample_the_target_through_its_static_graphs():
    """The target as exported graphs (run by torch eager), chains padded into a bucket of 4 rows, the draft
    model on torch: sd and specdec++ at T = 1 still draw (x1, x2) from the exact target."""
    from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec
    from streamfuse.export.verify import EagerRunner
    from streamfuse.runtime.backends.static_graph import StaticGraphBackend

    torch_target, engine = backend_for(5, vocab=8, gamma=2), backend_for(9, vocab=8, gamma=2)
    model, shapes = torch_target.model, GraphShapes(capacity=64, prefill_chunk=8, buckets=(4,))
    target = StaticGraphBackend(
        EagerRunner(graph_modules(model, shapes, None, ["deferred"])), graph_spec(model, shapes, ["deferred"])
    )
    exact = exact_joint(torch_target, SamplingConfig(1.0))
    for method, stop in (("sd", None), ("specdec++", StopRule(constant_head(0.7), 0.5))):
        counts = torch.zeros(8, 8)
        for seed in range(1000):
            settings = DecodeSettings(
                method, StopRules(2), tree=TreeSpec.chain(3 if stop else 2), sampling=SamplingConfig(1.0), seed=seed
            )
            tokens = generate(target, [1, 2], settings, drafter=ModelDrafter(engine, settings, stop)).token_ids
            counts[tokens[0], tokens[1]] += 1
        assert chi_square_p(counts, exact) > 1e-3, method
