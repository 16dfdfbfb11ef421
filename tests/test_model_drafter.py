"""Two-model speculative decoding through the one decode loop: greedy == plain, sampling == the target."""

import numpy as np
import pytest
import torch

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.methods.sd.drafter import ModelDrafter
from streamfuse.runtime.backends.base import PruneConfig
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.runtime.speculation.accept import accept_sampled
from streamfuse.runtime.speculation.fallback import FallbackConfig
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama
from test_decode import backend_for, chi_square_p, exact_joint


def sd(target, engine, prompt, settings, trace=None):
    return generate(target, prompt, settings, drafter=ModelDrafter(engine, settings), trace=trace)


@pytest.mark.parametrize("gamma, drafter_seed, prompt_len", [(1, 3, 1), (2, 3, 5), (4, 9, 7), (3, 2, 12)])
def test_greedy_draft_model_equals_plain_greedy(gamma, drafter_seed, prompt_len):
    target, engine = backend_for(1), backend_for(drafter_seed)
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    plain = generate(target, prompt, DecodeSettings("ar", rules))
    trace = Trace()
    fast = sd(target, engine, prompt, DecodeSettings("sd", rules, tree=TreeSpec.chain(gamma)), trace)
    assert (fast.token_ids, fast.stop_reason) == (plain.token_ids, plain.stop_reason)
    run = trace.runs[0]
    # Every drafted step costs gamma draft calls plus the pending tokens past the first: at least gamma.
    assert run.method == "sd" and all(step.draft_calls >= gamma for step in run.steps)
    assert run.draft_calls == 1 + sum(step.draft_calls for step in run.steps)  # + the drafter's prefill


def test_the_target_as_its_own_draft_model_accepts_every_draft():
    """Same weights on both sides: every greedy draft is the target's token, so each step emits
    gamma + 1 tokens. A draft cache rolled back or fed wrongly would draft from the wrong context."""
    target, engine = backend_for(4), backend_for(4)
    rules = StopRules(max_new_tokens=41)
    settings = DecodeSettings("sd", rules, tree=TreeSpec.chain(3))
    fast = sd(target, engine, [3, 1, 4, 1, 5], settings)
    assert fast.token_ids == generate(target, [3, 1, 4, 1, 5], DecodeSettings("ar", rules)).token_ids
    assert [step.accepted_depth for step in fast.run.steps[:-1]] == [3] * (len(fast.run.steps) - 1)
    assert fast.run.model_calls == 1 + 10  # 1 prefill token, then 4 per call


def test_fallback_goes_plain_with_a_useless_draft_model_and_keeps_the_drafter_in_step():
    """A random draft model: the fallback switches to plain decoding; on each probe the draft model
    catches up on the plain tokens it missed, so outputs stay plain decoding's."""
    target, engine = backend_for(1), backend_for(8)
    rules = StopRules(max_new_tokens=80)
    settings = DecodeSettings(
        "sd", rules, tree=TreeSpec.chain(3), fallback=FallbackConfig(step_cost=2.5, block=4, probe=2, pause=8)
    )
    fast = sd(target, engine, [2, 7], settings)
    assert fast.token_ids == generate(target, [2, 7], DecodeSettings("ar", rules)).token_ids
    assert fast.run.plain_calls > 0 and fast.run.switches[0].to == "plain"


def test_sampled_drafts_are_reproducible_from_the_seed():
    target, engine = backend_for(2), backend_for(6)
    settings = DecodeSettings("sd", StopRules(20), tree=TreeSpec.chain(2), sampling=SamplingConfig(0.8), seed=3)
    first = sd(target, engine, [1, 2, 3], settings).token_ids
    assert sd(target, engine, [1, 2, 3], settings).token_ids == first


def joint_counts(target, engine, runs):
    counts = torch.zeros(8, 8)
    for seed in range(runs):
        settings = DecodeSettings("sd", StopRules(2), tree=TreeSpec.chain(2), sampling=SamplingConfig(1.0), seed=seed)
        tokens = sd(target, engine, [1, 2], settings).token_ids
        counts[tokens[0], tokens[1]] += 1
    return counts


def test_speculative_sampling_matches_the_target_distribution():
    """2000 samples of (x1, x2) over an 8-token vocabulary from SD with a different draft model,
    chi-square against the exact target. Control: the draft model's own joint fails the same test,
    so a rule that kept its drafts unchecked would be caught."""
    target, engine = backend_for(5, vocab=8, gamma=2), backend_for(9, vocab=8, gamma=2)
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_joint(target, sampling)
    assert chi_square_p(joint_counts(target, engine, 2000), exact) > 1e-3
    drafts = exact_joint(engine, sampling).flatten()
    draws = torch.multinomial(drafts, 2000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert chi_square_p(torch.bincount(draws, minlength=64).float().view(8, 8), exact) < 1e-3


# accept_sampled on literal distributions over 3 tokens: (p after the root, q of the draft, draft) ->
# the acceptance probability min(1, p/q) and the correction's distribution on rejection, norm(max(0, p - q)).
ACCEPTANCE = [
    ([0.5, 0.3, 0.2], [0.5, 0.3, 0.2], 0, 1.0, None),  # q == p: always kept
    ([0.0, 0.5, 0.5], [1.0, 0.0, 0.0], 0, 0.0, [0.0, 0.5, 0.5]),  # p gives the draft nothing: always replaced
    ([0.2, 0.8, 0.0], [0.6, 0.2, 0.2], 0, 1 / 3, [0.0, 1.0, 0.0]),  # kept with 0.2 / 0.6; residual (0, .6, 0)
]


@pytest.mark.parametrize("p, q, token, keep, residual", ACCEPTANCE)
def test_speculative_sampling_keeps_a_draft_with_p_over_q(p, q, token, keep, residual):
    tree, generator = TreeSpec.chain(1), np.random.default_rng(0)
    p, q = np.array(p), np.array(q)
    after = np.array([0.0, 0.0, 1.0])  # the target after the draft, for a fully accepted chain
    probs = np.stack([np.zeros(3), q])
    results = [
        accept_sampled(tree, [9, token], probs, lambda n: p if n == 0 else after, generator) for _ in range(3000)
    ]
    kept = [r for r in results if r.path == [0, 1]]
    assert len(kept) / len(results) == pytest.approx(keep, abs=0.03)
    assert all(r.correction == 2 for r in kept)
    if residual is not None:
        corrections = torch.bincount(torch.tensor([r.correction for r in results if r.path == [0]]), minlength=3)
        assert (corrections / corrections.sum()).tolist() == pytest.approx(residual, abs=0.03)


def test_sd_settings_need_a_chain():
    with pytest.raises(ValueError, match="drafts a chain"):
        DecodeSettings("sd", StopRules(4), tree=TreeSpec.full(2, 2))
    with pytest.raises(ValueError, match="its drafter"):
        generate(backend_for(0), [1, 2], DecodeSettings("sd", StopRules(4), tree=TreeSpec.chain(2)))


# A draft model's pruned head (FR-Spec; SpeculativeStreamingLM.keep_vocab): its logits cover the kept ids, the
# host spreads them over the vocabulary with -inf elsewhere, so drafts and q stay inside the kept set.
def pruned_engine(seed: int, keep: list[int], vocab: int = 97, gamma: int = 3) -> TorchBackend:
    model = SpeculativeStreamingLM(make_tiny_llama(seed, vocab=vocab), StreamConfig(gamma, 2))
    model.keep_vocab(torch.tensor(keep))
    return TorchBackend(model)


class DraftLog(ModelDrafter):
    """Records every drafted token and its q."""

    def __init__(self, *args):
        super().__init__(*args)
        self.tokens, self.probs = [], []

    def propose(self, root):
        draft = super().propose(root)
        self.tokens += draft.tokens[1:]
        if draft.probs is not None:
            self.probs += list(draft.probs[1:])
        return draft


def test_a_pruned_head_gives_the_full_heads_logits_on_its_rows_and_minus_inf_elsewhere():
    keep = [0, 3, 4, 40, 96]
    full, pruned = backend_for(3), pruned_engine(3, keep)
    for backend in (full, pruned):
        backend.reset(16)
    whole, kept = full.prefill([1, 2, 3], False).main_logits, pruned.prefill([1, 2, 3], False).main_logits
    assert kept.shape == whole.shape == (1, 97)
    assert np.allclose(kept[:, keep], whole[:, keep], atol=1e-6)
    assert np.isneginf(np.delete(kept, keep, axis=1)).all()
    assert pruned.model.logits(torch.zeros(2, 32)).shape == (2, 5)  # the call reads 5 rows, not 97


@pytest.mark.parametrize(
    "ids, message",
    [
        ([3, 3], "ascending distinct"),
        ([5, 2], "ascending distinct"),
        ([0, 97], "ascending distinct"),
        ([], "ascending distinct"),
    ],
)
def test_a_kept_vocabulary_must_be_ascending_ids_inside_the_vocabulary(ids, message):
    model = SpeculativeStreamingLM(make_tiny_llama(0), StreamConfig(3, 2))
    with pytest.raises(ValueError, match=message):
        model.keep_vocab(torch.tensor(ids, dtype=torch.long))


@pytest.mark.parametrize("gamma, prompt_len", [(2, 4), (4, 9)])
def test_greedy_sd_with_a_pruned_draft_head_equals_plain_greedy(gamma, prompt_len):
    keep = sorted(set(range(0, 97, 2)) | {5})
    target, engine = backend_for(1), pruned_engine(3, keep)
    prompt = torch.randint(0, 97, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    settings = DecodeSettings("sd", rules, tree=TreeSpec.chain(gamma))
    drafter = DraftLog(engine, settings)
    fast = generate(target, prompt, settings, drafter=drafter)
    plain = generate(target, prompt, DecodeSettings("ar", rules))
    assert (fast.token_ids, fast.stop_reason) == (plain.token_ids, plain.stop_reason)
    assert drafter.tokens and set(drafter.tokens) <= set(keep)


def test_speculative_sampling_with_a_pruned_draft_head_matches_the_target_distribution():
    """The draft distribution q is zero outside the kept tokens (here 5 of 8); the target's tokens outside
    them still come, from the residual max(p - q, 0), at the target's rate."""
    keep = [0, 2, 3, 5, 6]
    target, engine = backend_for(5, vocab=8, gamma=2), pruned_engine(9, keep, vocab=8, gamma=2)
    exact = exact_joint(target, SamplingConfig(1.0))
    counts, drafted = torch.zeros(8, 8), []
    for seed in range(2000):
        settings = DecodeSettings("sd", StopRules(2), tree=TreeSpec.chain(2), sampling=SamplingConfig(1.0), seed=seed)
        drafter = DraftLog(engine, settings)
        tokens = generate(target, [1, 2], settings, drafter=drafter).token_ids
        counts[tokens[0], tokens[1]] += 1
        drafted += drafter.probs
    assert chi_square_p(counts, exact) > 1e-3
    outside = [t for t in range(8) if t not in keep]
    assert all(q[outside].sum() == 0 and q.sum() == pytest.approx(1) for q in drafted)
    assert exact.view(8, 8)[:, outside].sum() > 0.1 and counts[:, outside].sum() > 200  # the residual's share


@pytest.mark.parametrize("tree", [TreeSpec.chain(3), TreeSpec.full(2, 2)])
def test_a_pruned_head_model_decodes_ss_as_its_own_plain_decoding(tree):
    """In-graph argmax and top-k (greedy_step's targets and drafts) give token ids, not head columns."""
    keep = sorted(set(range(1, 97, 3)) | {5})
    engine = pruned_engine(2, keep)
    rules = StopRules(max_new_tokens=24)
    plain = generate(engine, [4, 8, 15], DecodeSettings("ar", rules))
    fast = generate(engine, [4, 8, 15], DecodeSettings("ss", rules, tree=tree))
    assert fast.token_ids == plain.token_ids and set(plain.token_ids) <= set(keep)
    with pytest.raises(ValueError, match="tree pruning reads the early-exit head over the whole vocabulary"):
        generate(engine, [4, 8], DecodeSettings("ss", rules, tree=tree, prune=PruneConfig(threshold=0.1)))
