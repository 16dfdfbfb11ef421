"""Several sequences in one step (runtime/request/batch.py): every sequence of a batch decodes exactly its
single-sequence
output, whatever the batch (B = 1, 2, 4, 8 of different prompts, lengths, methods, one sampled), in one batched call
per step where the graphs have one (the tiny artifact's ExecuTorch and ONNX Runtime graphs), one call per sequence
elsewhere (torch); a cancelled sequence frees its cache at once, one that finishes early leaves the rest going."""

import json

import pytest

from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.batch import CANCELLED, FAILED, BatchDecoder
from streamfuse.runtime.request.batch_policy import PlainRowsPolicy
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.lifecycle import State
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.fallback import FallbackConfig
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from tiny_export import EXPORTED, TREES, prompts

CHAIN = TreeSpec.parse("gamma=3,k=1")  # 4 nodes: a batched 4-row step on the tiny artifact


class CountingRunner:
    """The engine's session, counting each method's calls."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, {}

    def run(self, method, inputs):
        self.calls[method] = self.calls.get(method, 0) + 1
        return self.inner.run(method, inputs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def requests(count: int, trees: tuple[TreeSpec, ...]) -> list[tuple[list[int], DecodeSettings]]:
    """Different prompts, lengths and methods; the third one sampled with its own seed."""
    out = []
    for index, ids in enumerate(prompts(count, seed=count)):
        rules = StopRules(14 - 3 * (index % 4))  # the later ones shorter: they finish first
        if index % 2:
            settings = DecodeSettings(registry.plain(), rules)
        else:
            sampling = SamplingConfig(temperature=0.8, top_k=30) if index % 4 == 2 else SamplingConfig()
            tree = trees[(index // 2) % len(trees)]
            settings = DecodeSettings(registry.default(), rules, tree=tree, sampling=sampling, seed=index)
        out.append((ids, settings))
    return out


def single(loaded, ids, settings) -> list[int]:
    return generate(loaded.backend, ids, settings, drafter=loaded.drafter(settings)).token_ids


def decode_all(decoder: BatchDecoder, lanes) -> list[str]:
    """Step until every lane is done -> lane ids in the order they finished."""
    order = []
    while decoder.active:
        order.extend(lane.id for lane in decoder.step())
    assert all(lane.done for lane in lanes)
    return order


class EveryOther(PlainRowsPolicy):
    """Runs every other step of a batch as plain rows, whatever it measured."""

    def plain_rows(self, sequences: int) -> bool:
        return sequences > 1 and self.steps % 2 == 1


def check_batches(loaded, trees, policy: PlainRowsPolicy | None = None) -> None:
    for sequences in (1, 2, 4, 8):
        batch = requests(sequences, trees)
        decoder = BatchDecoder(loaded, max_sequences=8)
        decoder.policy = policy or decoder.policy
        lanes = [decoder.add(ids, settings) for ids, settings in batch]
        order = decode_all(decoder, lanes)
        assert sorted(order) == sorted(lane.id for lane in lanes)
        for lane, (ids, settings) in zip(lanes, batch):
            assert lane.result.token_ids == single(loaded, ids, settings), (sequences, lane.id)
        if sequences >= 4:
            assert order != [lane.id for lane in lanes]  # a shorter one finished first while others went on
        if policy is not None and sequences > 1:
            assert 0 < decoder.plain_steps < decoder.shared_steps <= decoder.steps


@pytest.fixture(scope="module")
def torch_model(checkpoint):
    return load(checkpoint / "ckpt")


def test_every_sequence_of_a_batch_equals_its_single_output_on_torch(torch_model):
    check_batches(torch_model, (CHAIN,))


@pytest.mark.parametrize("backend", EXPORTED)
def test_every_sequence_of_a_batch_equals_its_single_output_on_an_engine(artifact, backend):
    loaded = load(artifact, backend)
    counting = loaded.backend.runner = CountingRunner(loaded.backend.runner)
    check_batches(loaded, (TREES[1], TREES[0]))
    batched = {method: calls for method, calls in counting.calls.items() if method.startswith("batch_step")}
    if loaded.backend.spec.batches:
        assert batched, counting.calls  # the 4-row chains and the plain steps shared calls
    else:
        assert not batched


@pytest.mark.parametrize("backend", EXPORTED)
def test_steps_run_as_plain_rows_emit_what_the_method_would(artifact, backend):
    loaded = load(artifact, backend)
    check_batches(loaded, (TREES[1], TREES[0]), EveryOther())


def test_a_plain_rows_step_is_not_the_fallbacks_to_count(torch_model):
    """A batch's plain rows leave the fallback's block as it was: it judges the method's own steps only."""
    settings = DecodeSettings(registry.default(), StopRules(14), tree=CHAIN, fallback=FallbackConfig(1.5, probe=8))
    first, second = prompts(2, seed=3)
    decoder = BatchDecoder(torch_model, max_sequences=2)
    decoder.policy = EveryOther()
    lanes = [decoder.add(first, settings), decoder.add(second, settings)]
    switch = lanes[0].generation.switch
    decoder.step()  # the prefills, then a step of the method
    judged = len(switch._tokens)
    decoder.step()  # held
    assert decoder.plain_steps == 1 and len(switch._tokens) == judged == 1
    decode_all(decoder, lanes)
    assert [lane.result.token_ids for lane in lanes] == [single(torch_model, ids, settings) for ids in (first, second)]


@pytest.mark.parametrize("backend", [pytest.param("torch"), *EXPORTED])
def test_a_free_lane_serves_the_prompt_sharing_most_of_its_cache(artifact, backend):
    loaded = load(artifact, backend)
    settings = DecodeSettings(registry.default(), StopRules(6), tree=CHAIN)
    first, second = prompts(2, seed=5)
    decoder = BatchDecoder(loaded, max_sequences=2)
    lanes = [decoder.add(first + [7] * 30, settings), decoder.add(second + [9] * 30, settings)]
    decode_all(decoder, lanes)
    shared = second + [9] * 12 + [11, 12]  # 12 + len(second) rows shared with the second lane's cache
    added = decoder.add(shared, settings)
    assert added.model is lanes[1].model and added.generation.run.kept == len(second) + 12
    decode_all(decoder, [added])
    assert added.result.token_ids == single(loaded, shared, settings)
    assert added.generation.prefilled == 2  # only the rows past the shared prefix


@pytest.mark.parametrize("backend", [pytest.param("torch"), *EXPORTED])
def test_a_cancelled_sequence_frees_its_cache_for_the_next(artifact, backend):
    loaded = load(artifact, backend)
    batch = requests(3, (TREES[1],))
    decoder = BatchDecoder(loaded, max_sequences=3)
    lanes = [decoder.add(ids, settings) for ids, settings in batch]
    decoder.step()
    decoder.step()
    decoder.cancel(lanes[1])
    assert lanes[1].done and lanes[1] not in decoder.active and lanes[1].result.stop_reason == CANCELLED
    ids, settings = batch[1][0][::-1], batch[1][1]
    added = decoder.add(ids, settings)
    assert added.model is lanes[1].model  # the cancelled lane's cache serves it
    decode_all(decoder, [lanes[0], lanes[2], added])
    for lane, (prompt, options) in zip((lanes[0], lanes[2], added), (batch[0], batch[2], (ids, settings))):
        assert lane.result.token_ids == single(loaded, prompt, options)


class FailAtFirstStep:
    """A callback that takes the prefill's token, then raises in the first step."""

    def __init__(self):
        self.calls = 0

    def __call__(self, event):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("the caller's callback failed")


# what happens to one lane of max_new_tokens tokens, its `isolate`, its callback -> its state after add, after
# prefill(), at the end (after a cancel where asked), and its stop reason
LANE_STATES = [
    ("runs to its end", 4, False, None, False, State.DECODING, State.DONE, "max_new_tokens"),
    ("its prefill makes its only token", 1, False, None, False, State.DONE, State.DONE, "max_new_tokens"),
    ("cancelled after its prefill", 4, False, None, True, State.DECODING, State.CANCELLED, CANCELLED),
    ("its own step raises, isolated", 4, True, FailAtFirstStep, False, State.DECODING, State.FAILED, FAILED),
    ("its own step raises, not isolated", 4, False, FailAtFirstStep, False, State.DECODING, State.FAILED, FAILED),
]


@pytest.mark.parametrize(
    "case, tokens, isolate, on_step, cancel, prefilled, end, reason", LANE_STATES, ids=[c[0] for c in LANE_STATES]
)
def test_a_lane_moves_through_the_request_states(
    torch_model, case, tokens, isolate, on_step, cancel, prefilled, end, reason
):
    decoder = BatchDecoder(torch_model, max_sequences=1, isolate=isolate)
    settings = DecodeSettings(registry.default(), StopRules(tokens), tree=CHAIN)
    lane = decoder.add([5, 6, 7], settings, on_step() if on_step else None)
    assert lane.state is State.QUEUED and not lane.done
    decoder.prefill()
    assert lane.state is prefilled
    if cancel:
        decoder.cancel(lane)
    while lane in decoder.active:  # step() hands back a lane that ended, its prefill's included
        try:
            decoder.step()
        except RuntimeError as error:
            assert not isolate and "callback failed" in str(error)
            decoder.cancel(lane)  # a failed lane stays failed; its cache is freed with its rows unknown
    assert lane.state is end and lane.done and lane not in decoder.active
    assert lane.result.stop_reason == reason and (lane.error is not None) == (end is State.FAILED)
    assert decoder.held_ids() == (None if end is State.FAILED else lane.generation.cached_ids)


def test_a_bad_sequence_is_refused_when_added_and_a_full_batch_says_so(torch_model):
    decoder = BatchDecoder(torch_model, max_sequences=1)
    settings = DecodeSettings(registry.plain(), StopRules(3))
    with pytest.raises(ValueError, match="the prompt is empty"):
        decoder.add([], settings)
    decoder.add([5, 6], settings)
    with pytest.raises(ValueError, match="decodes 1 sequences already"):
        decoder.add([5, 6], settings)
    assert len(decoder.active) == 1 and not decoder._free  # the refused sequence's lane went to the next one
    (lane,) = decoder.active
    decode_all(decoder, [lane])
    assert lane.result.token_ids == single(torch_model, [5, 6], settings) and len(lane.result.token_ids) == 3


@pytest.mark.parametrize("backend", EXPORTED)
def test_the_batch_bench_measures_every_b_and_checks_every_output(artifact, backend, tmp_path, capsys):
    from streamfuse.tools import batch_bench

    out = tmp_path / "bench.json"
    argv = ["--artifact", str(artifact), "--backends", backend, "--batches", "1,2", "--prompts", "3"]
    argv += ["--max-new-tokens", "6", "--input-file", str(artifact.parent / "data" / "dialogsum.dev.jsonl")]
    assert batch_bench.main([*argv, "--batch-policy", "auto,method", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    settings = [(row["backend"], row["batch"], row["batch_policy"]) for row in rows]
    assert settings == [(backend, 1, "auto"), (backend, 1, "method"), (backend, 2, "auto"), (backend, 2, "method")]
    assert all(row["all_equal_to_single"] and row["tokens_per_second"] > 0 for row in rows)
    assert 3 <= rows[0]["tokens"] == rows[1]["tokens"] == rows[2]["tokens"] <= 18
    assert rows[0]["ratio_to_b1"] == rows[1]["ratio_to_b1"] == 1.0
    assert rows[2]["ttft_p95_ms"] >= rows[2]["ttft_p50_ms"] > 0
    for row in rows:
        assert 0 < row["prefill_share"] < 1 and row["decode_tokens_per_second"] > row["tokens_per_second"]
    assert rows[0]["plain_share"] == rows[1]["plain_share"] == rows[3]["plain_share"] == 0  # B = 1, or policy method
    assert f"| {backend} | method | 2 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        batch_bench.parse_args([*argv, "--batch-policy", "auto,sometimes"])
