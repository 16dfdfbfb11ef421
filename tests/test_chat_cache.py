"""A generation that keeps the cache its last one left (Generation.begin's `keep`) decodes what a fresh one does,
token for token, whether the new prompt extends the cached ids, leaves them mid-way or shares nothing; it
prefills only the tokens past the shared prefix. The rollback under it lands an engine's pending commit."""

import numpy as np
import pytest
import torch

from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.decode import Generation, generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from tiny_export import EXPORTED, TREES, path_of, prompts

CHAIN = TreeSpec.parse("gamma=3,k=1")
SAMPLED = SamplingConfig(temperature=0.8, top_k=30, top_p=0.95)
KINDS = ("extends", "diverges", "unrelated")  # how each turn's prompt relates to what the cache holds


def settings_of(case: str, tree: TreeSpec, turn: int) -> DecodeSettings:
    rules = StopRules(6 + turn % 3)
    if case == "plain":
        return DecodeSettings(registry.plain(), rules)
    if case == "default":
        return DecodeSettings(registry.default(), rules, tree=tree)
    return DecodeSettings(registry.default(), rules, tree=tree, sampling=SAMPLED, seed=turn)


def next_prompt(kind: str, history: list[int], rng: np.random.Generator) -> list[int]:
    """The next turn's prompt: the conversation so far (last prompt and answer) plus new tokens, the same with a
    token changed mid-way, or a new conversation."""
    user = rng.integers(3, 97, size=int(rng.integers(1, 6))).tolist()
    if kind == "unrelated":
        return [3 + (history[0] - 2) % 94] + user
    prompt = history + user
    if kind == "diverges":
        middle = len(prompt) // 2
        prompt[middle] = 3 + (prompt[middle] - 2) % 94
    return prompt


def fresh(backend, prompt: list[int], settings: DecodeSettings) -> list[int]:
    return generate(backend, prompt, settings).token_ids


def check_turns(kept_on, fresh_on, case: str, tree: TreeSpec, seed: int) -> list[int]:
    """5 turns on `kept_on` keeping its cache, each against a fresh generation on `fresh_on` -> rows prefilled."""
    rng = np.random.default_rng(seed)
    prompt, cached, history, prefilled = rng.integers(3, 97, size=9).tolist(), None, [], []
    for turn in range(5):
        if turn:
            prompt = next_prompt(KINDS[(turn + seed) % 3], history, rng)
        settings = settings_of(case, tree, turn)
        generation = Generation.begin(kept_on, prompt, settings, keep=cached)
        generation.start()
        while not generation.done:
            generation.step()
        answer = generation.result().token_ids
        assert answer == fresh(fresh_on, prompt, settings), (case, turn)
        shared = 0 if cached is None else common_prefix(cached, prompt)
        assert generation.prefilled == len(prompt) - min(shared, len(prompt) - 1) > 0
        assert generation.cached_ids[: len(prompt)] == prompt
        committed = generation.cached_ids[len(prompt) :]  # every emitted token but the last, then any cut off
        assert committed[: len(answer) - 1] == answer[: len(committed)][: len(answer) - 1]
        assert len(committed) >= len(answer) - 1
        cached, history = generation.cached_ids, prompt + answer
        prefilled.append(generation.prefilled)
    return prefilled


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def torch_model(checkpoint):
    return load(checkpoint / "ckpt")


@pytest.mark.parametrize("case", ["plain", "default", "sampled"])
def test_keeping_the_cache_on_torch_equals_fresh_generations(torch_model, case):
    lane = torch_model.backend.with_own_cache()
    prefilled = check_turns(lane, torch_model.backend, case, CHAIN, seed=1)
    assert any(count < 6 for count in prefilled[1:])  # some turn kept most of its prompt


@pytest.mark.parametrize("backend", EXPORTED)
@pytest.mark.parametrize("case", ["plain", "default", "sampled"])
def test_keeping_the_cache_on_an_engine_equals_fresh_generations(artifact, backend, case):
    loaded = load(artifact, backend)
    for seed, tree in enumerate(TREES):
        prefilled = check_turns(loaded.backend.with_own_cache(), loaded.backend, case, tree, seed)
        assert any(count < 6 for count in prefilled[1:])


@pytest.mark.parametrize("backend", EXPORTED)
def test_a_rollback_lands_the_engines_pending_commit_below_it(artifact, backend):
    """After a step's commit the engine moves the accepted rows into place on its next call; a rollback to a
    length past some of them keeps those moves, so the next prefill sees the path, not the tree's other rows."""
    engine, fresh_engine = load(artifact, backend).backend, load(artifact, backend).backend
    prompt, tree = prompts(1, seed=4)[0], TREES[0]
    tokens = torch.randint(3, 97, (tree.num_nodes,), generator=torch.Generator().manual_seed(5)).tolist()
    path = path_of(tree, tree.num_nodes - 1)
    assert path != list(range(len(path)))  # rows move: the path is not the first rows of the step
    cached = prompt + [tokens[node] for node in path]
    for length in (len(cached), len(prompt) + 2, len(prompt)):
        engine.reset(64)
        engine.prefill(prompt, with_streams=False)
        engine.step(tokens, tree, with_streams=False)
        engine.commit(path)
        engine.rollback(length)
        got = engine.prefill([7], with_streams=False).main_logits
        fresh_engine.reset(64)
        want = fresh_engine.prefill(cached[:length] + [7], with_streams=False).main_logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_backend_whose_last_call_failed_keeps_nothing(torch_model):
    """Its cache is unknown: the next generation prefills the whole prompt and still equals a fresh one."""
    lane, settings, prompt = torch_model.backend.with_own_cache(), settings_of("default", CHAIN, 0), [5, 9, 14, 20]
    first = Generation.begin(lane, prompt, settings)
    first.start()
    first.step()
    lane.call_failed("step_4", RuntimeError("engine gone"))
    second = Generation.begin(lane, prompt + [7], settings, keep=first.cached_ids)
    second.start()
    while not second.done:
        second.step()
    assert second.prefilled == len(prompt) + 1
    assert second.result().token_ids == fresh(torch_model.backend, prompt + [7], settings)
