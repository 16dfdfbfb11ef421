"""Lossless decoding: speculative greedy == plain greedy token for token; sampling matches the target."""

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.runtime.backends.base import PruneConfig, StepOutput
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.runtime.speculation.sampling import SamplingConfig, target_probs
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama


def backend_for(
    seed: int, vocab: int = 97, gamma: int = 3, msa_layers: int = 2, schedule: str = "fused"
) -> TorchBackend:
    model = SpeculativeStreamingLM(make_tiny_llama(seed, vocab=vocab), StreamConfig(gamma, msa_layers))
    return TorchBackend(model, stream_schedule=schedule)


class OracleDrafts:
    """Wraps a backend so streams propose the true future tokens, each corrupted with probability
    `noise`: deep paths get accepted, exercising multi-token commits and compaction."""

    def __init__(self, inner: TorchBackend, oracle: list[int], noise: float, seed: int):
        self.inner, self.oracle, self.noise = inner, oracle, noise
        self.rng = random.Random(seed)
        self.name, self.device = inner.name, inner.device
        self.num_streams, self.vocab_size, self.max_positions = inner.num_streams, inner.vocab_size, inner.max_positions
        self.prompt_len = 0

    def reset(self, capacity):
        self.inner.reset(capacity)

    def step_rows(self, tree):
        return self.inner.step_rows(tree)

    def prefill(self, token_ids, with_streams):
        self.prompt_len = len(token_ids)
        return self._oracle_streams(self.inner.prefill(token_ids, with_streams))

    def step(self, tokens, tree, with_streams, prune=None, greedy=False):
        # Logits, not the engine's greedy step: the oracle replaces the streams the greedy step would rank.
        return self._oracle_streams(self.inner.step(tokens, tree, with_streams, prune))

    def commit(self, nodes):
        self.inner.commit(nodes)

    def peak_memory_bytes(self):
        return None

    def _oracle_streams(self, out: StepOutput) -> StepOutput:
        def streams(node: int) -> np.ndarray:
            done = self.inner.length - self.prompt_len  # tokens already in the cache
            logits = torch.randn(self.num_streams, self.vocab_size)
            for depth in range(1, self.num_streams + 1):
                index = done + depth
                if index < len(self.oracle) and self.rng.random() > self.noise:
                    logits[depth - 1, self.oracle[index]] = 100.0
            return logits.numpy()

        return StepOutput(out.main_logits, streams, out.kept)


trees = st.one_of(
    st.builds(TreeSpec.full, gamma=st.integers(1, 3), k=st.integers(1, 3)),
    st.builds(
        lambda g, k, n: TreeSpec.full(g, k).with_lookup(min(n, g)),
        st.integers(1, 3),
        st.integers(1, 2),
        st.integers(1, 3),
    ),
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), min_size=1, max_size=8).map(
        lambda paths: TreeSpec(tuple({tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}))
    ),
)


# No shrinking phase: a failure prints its example at once instead of minutes of shrinking in CI.
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 10_000),
    tree=trees,
    noise=st.sampled_from([0.0, 0.3, 1.0]),
    prompt_len=st.integers(1, 12),
    prune=st.sampled_from([None, PruneConfig(budget=3), PruneConfig(threshold=0.02)]),
    schedule=st.sampled_from(["fused", "deferred"]),
)
def test_speculative_greedy_equals_plain_greedy(seed, tree, noise, prompt_len, prune, schedule):
    backend = backend_for(seed % 7, schedule=schedule)
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    rules = StopRules(max_new_tokens=24, stop_token_ids=(5,))
    plain = generate(backend, prompt, DecodeSettings("ar", rules))
    for drafter in (backend, OracleDrafts(backend, plain.token_ids, noise, seed)):
        fast = generate(drafter, prompt, DecodeSettings("ss", rules, tree=tree, prune=prune))
        assert fast.token_ids == plain.token_ids
        assert fast.stop_reason == plain.stop_reason
        assert fast.run.model_calls <= plain.run.model_calls


def test_lookup_branch_drafts_are_accepted_where_the_output_repeats_its_context():
    """Streams that draft at random (noise 1.0) rarely hit, so lookup must carry most accepted
    drafts. The prompt holds the plain answer's own beginning, so lookup has copies to draw on."""
    backend = backend_for(5, schedule="deferred")
    rules = StopRules(max_new_tokens=40)
    answer = generate(backend, [7, 8, 9], DecodeSettings("ar", rules)).token_ids
    prompt = [7, 8, 9, *answer[:20], 7, 8, 9]
    plain = generate(backend, prompt, DecodeSettings("ar", rules))
    lookup = DecodeSettings("ss", rules, tree=TreeSpec.chain(3).with_lookup(3))
    fast = generate(OracleDrafts(backend, plain.token_ids, 1.0, 0), prompt, lookup)
    assert fast.token_ids == plain.token_ids
    accepted = sum(step.accepted_depth for step in fast.run.steps)
    from_lookup = sum(step.lookup_accepted for step in fast.run.steps)
    assert from_lookup >= 3 and 0.8 * accepted <= from_lookup <= accepted
    assert fast.run.model_calls < plain.run.model_calls


def test_oracle_drafts_cut_model_calls_by_the_tree_depth():
    backend = backend_for(3, schedule="deferred")
    rules = StopRules(max_new_tokens=30)
    plain = generate(backend, [1, 2, 3], DecodeSettings("ar", rules))
    trace = Trace()
    chain = DecodeSettings("ss", rules, tree=TreeSpec.chain(3))
    fast = generate(OracleDrafts(backend, plain.token_ids, 0.0, 0), [1, 2, 3], chain, trace=trace)
    assert fast.token_ids == plain.token_ids
    # Every step accepts all 3 drafts + a correction: 1 prefill token, then 4 per call.
    assert [s.accepted_depth for s in fast.run.steps[:-1]] == [3] * (len(fast.run.steps) - 1)
    assert fast.run.model_calls == 1 + -(-29 // 4)
    assert trace.runs[0].spans["forward"] > 0


@pytest.mark.parametrize("schedule", ["fused", "deferred"])
def test_seeded_sampling_matches_plain_sampling_token_for_token(schedule):
    """Each emitted token costs exactly one draw from the target in both loops, so with one seed
    speculative sampling reproduces plain sampling."""
    backend = backend_for(11, schedule=schedule)
    sampling = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95)
    rules = StopRules(max_new_tokens=20)
    for seed in range(4):
        plain = generate(backend, [4, 5, 6], DecodeSettings("ar", rules, sampling=sampling, seed=seed))
        oracle = OracleDrafts(backend, plain.token_ids, 0.2, seed)
        fast = generate(
            oracle, [4, 5, 6], DecodeSettings("ss", rules, tree=TreeSpec.full(3, 2), sampling=sampling, seed=seed)
        )
        assert fast.token_ids == plain.token_ids
        assert fast.run.model_calls < plain.run.model_calls


def joint_counts(backend, sampling, runs, tree):
    counts = torch.zeros(8, 8)
    rules = StopRules(max_new_tokens=2)
    for seed in range(runs):
        settings = DecodeSettings("ss", rules, tree=tree, sampling=sampling, seed=seed)
        tokens = generate(backend, [1, 2], settings).token_ids
        counts[tokens[0], tokens[1]] += 1
    return counts


@torch.no_grad()
def exact_joint(backend, sampling):
    model = backend.model
    prompt = torch.tensor([[1, 2]])
    first = _probs(model.logits(model(prompt, torch.arange(2)[None], _causal(2)).hidden[0, -1]), sampling)
    joint = torch.zeros(8, 8)
    for token in range(8):
        ids = torch.tensor([[1, 2, token]])
        second = _probs(model.logits(model(ids, torch.arange(3)[None], _causal(3)).hidden[0, -1]), sampling)
        joint[token] = first[token] * second
    return joint


def _probs(logits: torch.Tensor, sampling) -> torch.Tensor:
    return torch.from_numpy(target_probs(logits.numpy(), sampling))


def _causal(n):
    from streamfuse.adapters.masks import causal_mask

    return causal_mask(torch.ones(1, n, dtype=torch.long))


def chi_square_p(counts, probs):
    from scipy.stats import chisquare

    expected = probs.flatten() * counts.sum()
    keep = expected > 0
    return chisquare(
        counts.flatten()[keep].numpy(), expected[keep].numpy() * counts.sum().item() / expected[keep].sum().item()
    ).pvalue


def test_speculative_sampling_matches_the_target_distribution():
    """2000 speculative samples of (x1, x2) over an 8-token vocabulary, chi-square against the
    exact target probabilities. As a control, 2000 draws from the exact joint at another
    temperature must fail the same test: the sample size has the power to catch a wrong rule."""
    backend = backend_for(5, vocab=8, gamma=2)
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_joint(backend, sampling)
    speculative = joint_counts(backend, sampling, 2000, tree=TreeSpec.full(2, 2))
    assert chi_square_p(speculative, exact) > 1e-3
    other = exact_joint(backend, SamplingConfig(temperature=1.6)).flatten()
    draws = torch.multinomial(other, 2000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert chi_square_p(torch.bincount(draws, minlength=64).float().view(8, 8), exact) < 1e-3


@pytest.mark.parametrize("prompt, message", [([], "empty"), ([1, 200], "outside the vocabulary")])
def test_bad_prompts_are_clear_errors(prompt, message):
    with pytest.raises(ValueError, match=message):
        generate(backend_for(0), prompt, DecodeSettings("ss", StopRules(4), tree=TreeSpec.full(2, 2)))


def test_prompt_longer_than_the_context_is_a_clear_error():
    backend = backend_for(0)  # max_position_embeddings 256
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        generate(backend, [1] * 250, DecodeSettings("ss", StopRules(4), tree=TreeSpec.full(2, 2)))
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        generate(backend, [1] * 200, DecodeSettings("ar", StopRules(60)))


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopRules(0)
    with pytest.raises(ValueError, match="needs 3 streams but the model has 2"):
        generate(backend_for(0, gamma=2), [1], DecodeSettings("ss", StopRules(4), tree=TreeSpec.full(3, 1)))
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-1)


def test_stop_strings_stop_at_the_same_token():
    backend = backend_for(2)
    decode = lambda ids: " ".join(str(i) for i in ids)  # noqa: E731
    plain = generate(backend, [7, 8], DecodeSettings("ar", StopRules(40)), detokenizer=decode)
    stop = " ".join(str(t) for t in plain.token_ids[5:7])
    rules = StopRules(40, stop_strings=(stop,))
    a = generate(backend, [7, 8], DecodeSettings("ar", rules), detokenizer=decode)
    chain = DecodeSettings("ss", rules, tree=TreeSpec.chain(3))
    b = generate(OracleDrafts(backend, plain.token_ids, 0.0, 1), [7, 8], chain, detokenizer=decode)
    assert a.token_ids == b.token_ids == plain.token_ids[: len(a.token_ids)]
    assert a.stop_reason == b.stop_reason == "stop_string" and len(a.token_ids) <= 7


def test_real_stream_drafts_are_identical_under_both_schedules():
    """Not only the output: the drafted trees (hence acceptance and call counts) match too."""
    runs = []
    for schedule in ("fused", "deferred"):
        result = generate(
            backend_for(4, schedule=schedule),
            [3, 1, 4, 1, 5],
            DecodeSettings("ss", StopRules(30), tree=TreeSpec.full(3, 2)),
        )
        runs.append((result.token_ids, [(s.accepted_depth, s.tokens) for s in result.run.steps]))
    assert runs[0] == runs[1]
