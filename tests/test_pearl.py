"""PEARL (methods/pearl/drafter.py): the draft model in its own process, drafting while the target verifies;
greedy == plain decoding, sampling == the target distribution, whatever the timing."""

import pytest
import torch

from streamfuse.adapters.checkpoint import save_checkpoint
from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.methods.pearl.drafter import PearlDrafter, PearlWorker
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.runtime.speculation.sampling import SamplingConfig, target_probs
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama, make_tiny_tokenizer
from test_decode import backend_for, chi_square_p


def draft_checkpoint(root, seed: int, vocab: int = 97, layers: int = 4):
    """A checkpoint whose main stream is make_tiny_llama(seed)'s: the target of backend_for(seed) when layers = 4."""
    make_tiny_llama(seed, layers=layers, vocab=vocab).save_pretrained(root / "base")
    make_tiny_tokenizer().save_pretrained(root / "base")
    model = SpeculativeStreamingLM(
        add_lora(make_tiny_llama(seed, layers=layers, vocab=vocab), LoraSettings(rank=4)), StreamConfig(1, 1)
    )
    save_checkpoint(model, make_tiny_tokenizer(), root / "ckpt", str(root / "base"), LoraSettings(rank=4), {})
    return root / "ckpt"


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """seed -> a worker serving make_tiny_llama(seed) (one spawn each: a fresh interpreter takes seconds)."""
    made = {}

    def get(seed: int, vocab: int = 97, layers: int = 4) -> PearlWorker:
        if (seed, vocab, layers) not in made:
            folder = draft_checkpoint(tmp_path_factory.mktemp(f"draft{seed}-{vocab}-{layers}"), seed, vocab, layers)
            made[seed, vocab, layers] = PearlWorker(folder, "torch", load)
        return made[seed, vocab, layers]

    yield get
    for worker in made.values():
        worker.close()


def pearl(target, worker, prompt, settings, trace=None):
    return generate(target, prompt, settings, drafter=PearlDrafter(worker, settings), trace=trace)


@pytest.mark.parametrize("gamma, prompt", [(1, [3]), (3, [5, 9, 14, 3]), (5, [7, 7, 21, 2, 40, 11])])
def test_greedy_pearl_with_another_draft_model_equals_plain_greedy(workers, gamma, prompt):
    target = backend_for(1)
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    settings = DecodeSettings("pearl", rules, tree=TreeSpec.chain(gamma))
    trace = Trace()
    fast = pearl(target, workers(3, layers=2), prompt, settings, trace)
    plain = generate(target, prompt, DecodeSettings("ar", rules))
    assert (fast.token_ids, fast.stop_reason) == (plain.token_ids, plain.stop_reason)
    run = trace.runs[0]
    assert run.method == "pearl" and run.plain_calls > 0  # a random draft misses: pre-verify steps
    assert all(step.tree_nodes == gamma + 1 for step in run.steps)  # post-verify verifies gamma drafts


def test_the_target_as_its_own_draft_stays_in_post_verify_after_the_first_step(workers):
    """Same weights on both sides: one pre-verify step (a plain step while the worker drafts the first
    tokens), then every chain is accepted whole and the worker's next draft is the target's correction,
    so no step goes plain again: gamma + 1 tokens per target call."""
    target, rules = backend_for(4), StopRules(max_new_tokens=41)
    settings = DecodeSettings("pearl", rules, tree=TreeSpec.chain(3))
    trace = Trace()
    fast = pearl(target, workers(4), [3, 1, 4, 1, 5], settings, trace)
    assert fast.token_ids == generate(target, [3, 1, 4, 1, 5], DecodeSettings("ar", rules)).token_ids
    run = trace.runs[0]
    assert run.plain_calls == 1 and [step.accepted_depth for step in run.steps[:-1]] == [3] * (len(run.steps) - 1)
    assert run.model_calls == 1 + 1 + 10  # prefill, one pre-verify step, then 4 tokens per call


def test_runs_in_a_row_share_the_worker_and_give_the_same_tokens(workers):
    target, worker = backend_for(1), workers(3, layers=2)
    rules = StopRules(max_new_tokens=16)
    settings = DecodeSettings("pearl", rules, tree=TreeSpec.chain(2))
    first = [pearl(target, worker, prompt, settings).token_ids for prompt in ([1, 2], [9, 8, 7])]
    assert [pearl(target, worker, prompt, settings).token_ids for prompt in ([1, 2], [9, 8, 7])] == first


def exact_pair_after_first(backend, sampling) -> torch.Tensor:
    """[8, 8]: the exact target's P(x2, x3) after the prompt [1, 2] (x1 summed out)."""
    model = backend.model

    def probs(ids):
        hidden = model(torch.tensor([ids]), torch.arange(len(ids))[None], causal(len(ids))).hidden[0, -1]
        return torch.from_numpy(target_probs(model.logits(hidden).numpy(), sampling))

    pair = torch.zeros(8, 8)
    with torch.no_grad():
        first = probs([1, 2])
        for x1 in range(8):
            second = probs([1, 2, x1])
            for x2 in range(8):
                pair[x2] += first[x1] * second[x2] * probs([1, 2, x1, x2])
    return pair


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def test_pearl_sampling_matches_the_target_distribution(workers):
    """(x1, x2, x3) over an 8-token vocabulary: x2 from the plain pre-verify step, x3 from a chain the worker
    drafted meanwhile (when its first draft was x2) by speculative sampling, else from another plain step;
    (x2, x3) against the exact target's."""
    target, worker = backend_for(5, vocab=8, gamma=2), workers(9, vocab=8)
    sampling = SamplingConfig(temperature=1.0)
    counts, chained = torch.zeros(8, 8), 0
    for seed in range(1500):
        settings = DecodeSettings("pearl", StopRules(3), tree=TreeSpec.chain(2), sampling=sampling, seed=seed)
        trace = Trace()
        tokens = pearl(target, worker, [1, 2], settings, trace).token_ids
        counts[tokens[1], tokens[2]] += 1
        chained += bool(trace.runs[0].steps)
    assert chi_square_p(counts, exact_pair_after_first(target, sampling)) > 1e-3
    assert chained > 100  # the worker's chains were verified, not only plain steps


def test_seeded_sampling_gives_the_same_tokens_whatever_the_timing(workers):
    target, worker = backend_for(2), workers(6, layers=2)
    settings = DecodeSettings("pearl", StopRules(20), tree=TreeSpec.chain(3), sampling=SamplingConfig(0.8), seed=3)
    first = pearl(target, worker, [1, 2, 3], settings).token_ids
    torch.set_num_threads(1)  # a slower target: the worker gets further ahead
    try:
        assert pearl(target, worker, [1, 2, 3], settings).token_ids == first
    finally:
        torch.set_num_threads(2)


def test_a_worker_that_cannot_load_its_model_is_one_error_naming_the_folder(tmp_path):
    with pytest.raises(RuntimeError, match=f"failed to load {tmp_path}"):
        PearlWorker(tmp_path, "torch", load)


def test_pearl_settings_need_a_chain():
    with pytest.raises(ValueError, match="drafts a chain"):
        DecodeSettings("pearl", StopRules(4), tree=TreeSpec.full(2, 2))
