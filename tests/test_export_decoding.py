"""An exported tiny artifact decodes as the torch model does: SS equals plain decoding (greedy and seeded sampling),
every tree row is plain decoding of its path bit for bit, every method samples the exact target, one call a step."""

from collections import Counter

import numpy as np
import pytest
import torch

from streamfuse.export.artifact import ExportConfig
from streamfuse.runtime.backends.base import HIDDEN
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import write_checkpoint
from tiny_export import CONFIG, DRAFT, EXPORTED, TREES, build, build_beside, needs, path_of, prompts


@pytest.mark.parametrize("backend", EXPORTED)
def test_greedy_ss_on_exported_backend_equals_torch_eager(artifact, backend):
    loaded = load(artifact, backend)
    eager = load(artifact, "torch", stream_schedule="deferred")
    tree = loaded.tree
    assert tree == TREES[0] and eager.tree == tree and loaded.max_nodes == 15  # no calibration: the default tree
    rules = StopRules(30)
    # The same shape with a prompt-lookup branch: only the host's drafts change; repeated prompts give it matches.
    lookup_tree = TreeSpec(tree.paths, lookup=(1, 1, 1))
    for ids in prompts(4, seed=1) + [ids * 2 for ids in prompts(2, seed=2)]:
        expected = generate(eager.backend, ids, DecodeSettings("ar", rules)).token_ids
        for drafts in (tree, lookup_tree, TREES[1], TreeSpec.full(2, 3)):  # 13 nodes: padded into 15 rows
            settings = DecodeSettings("ss", rules, tree=drafts)
            assert generate(loaded.backend, ids, settings).token_ids == expected
        assert generate(loaded.backend, ids, DecodeSettings("ar", rules)).token_ids == expected
        medusa = DecodeSettings("medusa", rules, tree=loaded.method_tree("medusa"))  # the graphs' heads method
        assert generate(loaded.backend, ids, medusa, drafter=loaded.drafter(medusa)).token_ids == expected
    assert loaded.backend.name.startswith("executorch" if backend == "executorch" else "onnxruntime:")


class CountingRunner:
    def __init__(self, session):
        self.session, self.name, self.calls = session, session.name, Counter()

    def run(self, method, inputs):
        self.calls[method] += 1
        return self.session.run(method, inputs)


@pytest.mark.parametrize("backend", EXPORTED)
def test_greedy_steps_are_one_call_each_and_sampling_keeps_separate_streams(artifact, backend):
    loaded = load(artifact, backend)
    counting = CountingRunner(loaded.backend.runner)
    loaded.backend.runner = counting
    rules = StopRules(30)
    drafted = []
    result = generate(
        loaded.backend,
        prompts(1, seed=4)[0],
        DecodeSettings("ss", rules, tree=loaded.tree),
        on_step=lambda event: drafted.extend(event.drafted),
    )
    steps = result.run.model_calls - 1
    assert steps > 0 and counting.calls["greedy_step_15"] == steps
    assert set(drafted[3:]) <= set(DRAFT.ids)  # after the prefill's drafts, only the draft vocabulary
    assert counting.calls["streams"] == 1 and counting.calls["step_15"] == 0  # streams: the prefill's only
    counting.calls.clear()
    sampled = DecodeSettings("ss", rules, tree=loaded.tree, sampling=SamplingConfig(temperature=1.0))
    generate(loaded.backend, prompts(1, seed=4)[0], sampled)
    assert counting.calls["greedy_step_15"] == 0 and counting.calls["step_15"] == counting.calls["streams"] - 1 > 0
    counting.calls.clear()
    chain = DecodeSettings("ss", rules, tree=TREES[1])
    one_call = generate(loaded.backend, prompts(1, seed=4)[0], chain).token_ids
    assert counting.calls["greedy_step_4"] > 0 and set(counting.calls) == {"prefill", "streams", "greedy_step_4"}
    # where calibration timed step, then streams faster for a bucket, that bucket's greedy steps take two calls
    loaded.backend.use_two_calls([TREES[1]])
    counting.calls.clear()
    assert generate(loaded.backend, prompts(1, seed=4)[0], chain).token_ids == one_call
    assert counting.calls["greedy_step_4"] == 0 and counting.calls["step_4"] == counting.calls["streams"] - 1 > 0
    counting.calls.clear()
    generate(loaded.backend, prompts(1, seed=4)[0], DecodeSettings("ss", rules, tree=loaded.tree))
    assert counting.calls["greedy_step_15"] > 0 and counting.calls["step_15"] == 0  # the other bucket: one call


@pytest.mark.parametrize("backend", EXPORTED)
def test_a_failed_engine_call_leaves_the_loaded_model_as_a_fresh_load(artifact, backend):
    """test_engine_state.py's checks on the engine itself: after a call that raised mid-step (the moves of a commit
    pending) or mid-generation, the same loaded model refuses calls until its reset and then generates what a fresh
    load does."""
    from test_engine_state import check_recovery

    check_recovery(load(artifact, backend).backend, load(artifact, backend).backend)


def second_token_marginal(eager, prompt: list[int], sampling: SamplingConfig) -> torch.Tensor:
    """P(x2) = sum over x1 of P(x1) P(x2 | x1): the target's exact law of the second sampled token."""
    from streamfuse.runtime.speculation.sampling import target_probs

    def next_probs(ids: list[int]) -> torch.Tensor:
        eager.reset(len(ids) + 1)
        return torch.from_numpy(target_probs(eager.prefill(ids, with_streams=False).main_logits[0], sampling))

    first = next_probs(prompt)
    return sum(first[x1] * next_probs(prompt + [x1]) for x1 in range(len(first)))


def pooled_chi_square_p(counts: torch.Tensor, probs: torch.Tensor, least: float = 5.0) -> float:
    """Chi-square p-value with the cells expected fewer than `least` times pooled into one."""
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    small = expected < least
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    wanted = torch.cat([expected[~small], expected[small].sum()[None]])
    return chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue


# Each method's law on one engine, SS's on both: what differs between the engines is their graphs' outputs, which
# test_every_tree_row_is_plain_decoding_of_its_path_bit_for_bit checks row by row on each.
LAW_METHODS = {"executorch": ("ss", "medusa", "sd"), "onnxruntime": ("ss", "ss-adaptive", "specdec++")}


@pytest.mark.parametrize("backend", EXPORTED)
def test_every_method_samples_the_exact_target_on_the_engine_itself(artifact, backend):
    """At T = 1, the second token (drafted in the first step, or its correction) of 1,000 runs per method
    on an exported engine, against its exact law from the torch model: SS and ss-adaptive (the trees
    chosen per step by a random head), Medusa through the heads method, sd and specdec++ with a draft
    model on torch verifying chains in the chain graph (LAW_METHODS: which engine runs which)."""
    from streamfuse.methods.sd.drafter import ModelDrafter
    from streamfuse.methods.specdec.drafter import StopRule
    from streamfuse.methods.ss_adaptive.drafter import AdaptiveStreamDrafter
    from streamfuse.runtime.speculation.calibration import AcceptanceModel, BackendCalibration, TreeCost
    from streamfuse.runtime.speculation.tree_choice import TreeChoice

    from test_decode import backend_for
    from test_specdec import constant_head
    from test_tree_choice import random_head

    loaded, sampling, prompt = load(artifact, backend), SamplingConfig(temperature=1.0), [5, 9, 14]
    exact = second_token_marginal(load(artifact, "torch").backend, prompt, sampling)
    acceptance = AcceptanceModel(4, 3, ((((0, 0, 0), -1), ((1,), -1), ((), -1), ((0, 1), -1)),))
    costs = (TreeCost(TREES[0], 2.0, 1.0, 1.0), TreeCost(TREES[1], 1.3, 1.0, 1.0))
    calibration = BackendCalibration("test", 1, 1.0, costs, 0.001, 10.0)
    adaptive = AdaptiveStreamDrafter(TreeChoice.from_calibration(acceptance, calibration), random_head(1), 3)
    draft_model, chain = backend_for(9), TREES[1]
    methods = {
        "ss": (None, TREES[0]),
        "ss-adaptive": (adaptive, adaptive.tree),
        "medusa": (
            loaded.drafter(DecodeSettings("medusa", StopRules(3), tree=loaded.method_tree("medusa"))),
            loaded.method_tree("medusa"),
        ),
        "sd": (ModelDrafter(draft_model, DecodeSettings("sd", StopRules(3), tree=chain)), chain),
        "specdec++": (
            ModelDrafter(
                draft_model, DecodeSettings("specdec++", StopRules(3), tree=chain), StopRule(constant_head(0.7), 0.5)
            ),
            chain,
        ),
    }
    assert {m for ms in LAW_METHODS.values() for m in ms} == set(methods)
    for method in LAW_METHODS[backend]:
        drafter, tree = methods[method]
        counts = torch.zeros(len(exact))
        for seed in range(1000):
            settings = DecodeSettings(method, StopRules(3), tree=tree, sampling=sampling, seed=seed)
            counts[generate(loaded.backend, prompt, settings, drafter=drafter).token_ids[1]] += 1
        assert pooled_chi_square_p(counts, exact) > 1e-3, method


@needs("onnxruntime")
def test_prefill_spanning_several_chunks_matches_eager(artifact):
    loaded, eager = load(artifact, "onnxruntime"), load(artifact, "torch")
    ids = prompts(1, seed=2)[0] * 3  # > 2 chunks of 16
    assert len(ids) > 2 * CONFIG.prefill_chunk
    exported = loaded.backend
    exported.reset(len(ids) + 16)
    eager.backend.reset(len(ids) + 16)
    got = exported.prefill(ids, with_streams=True)
    want = eager.backend.prefill(ids, with_streams=True)
    torch.testing.assert_close(got.main_logits, want.main_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.stream_logits(0), want.stream_logits(0), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", EXPORTED)
def test_every_row_returns_its_final_state_as_the_torch_model_does(artifact, backend):
    """hidden (what specdec++'s head reads off a draft model) of prefill, decode and a tree step, against the
    torch backend's final states, row for row; a tree inside a larger graph returns its own nodes' rows."""
    exported, eager = load(artifact, backend).backend, load(artifact, "torch").backend
    sub_chain = TreeSpec.chain(TREES[1].depth - 1)
    outputs = []
    for engine in (exported, eager):
        engine.reset(64)
        prefill = engine.prefill([5, 9, 14], with_streams=False)
        decode = engine.step([7], None, with_streams=False)
        engine.commit([0])
        step = engine.step([3] * sub_chain.num_nodes, sub_chain, with_streams=False)
        outputs.append([prefill.extras[HIDDEN], decode.extras[HIDDEN], step.extras[HIDDEN]])
    assert exported.spec.bucket(sub_chain) == 4 > sub_chain.num_nodes  # it rides, padded, in the 4-row bucket
    for got, want, rows in zip(*outputs, (1, 1, sub_chain.num_nodes)):
        assert got.shape == want.shape == (rows, eager.model.parts.hidden_size)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", EXPORTED)
def test_every_tree_row_is_plain_decoding_of_its_path_bit_for_bit(artifact, backend):
    """Each node of a tree with siblings (its ancestors in the call at other slots than plain decoding
    puts them, and pad rows beside them) has plain decoding's logits and final state, bit for bit: the
    exactness that keeps a quantized artifact's SS equal to its plain decoding, where rounding amplifies
    any difference."""
    engine = load(artifact, backend).backend
    prompt = (prompts(1, seed=3)[0] * 56)[:56]
    for tree in (TreeSpec(((0,), (1,))), TREES[0]):  # 3 nodes and a pad row in the 4-row bucket; 15 nodes
        tokens = torch.randint(3, 97, (tree.num_nodes,), generator=torch.Generator().manual_seed(7)).tolist()
        engine.reset(64)
        engine.prefill(prompt, with_streams=False)
        step = engine.step(tokens, tree, with_streams=False)
        for node in range(tree.num_nodes):
            engine.reset(64)
            engine.prefill(prompt, with_streams=False)
            for ancestor in path_of(tree, node):
                plain = engine.step([tokens[ancestor]], None, with_streams=False)
                engine.commit([0])
            assert np.array_equal(plain.main_logits[0], step.main_logits[node]), (tree.paths, node)
            assert np.array_equal(plain.extras[HIDDEN][0], step.extras[HIDDEN][node]), (tree.paths, node)


@pytest.mark.parametrize("backend", EXPORTED)
def test_seeded_sampling_ss_equals_plain_sampling_on_exported_backends(artifact, backend):
    """With one seed each emitted token costs one draw from the target in both loops (test_decode),
    so sampled SS equals sampled plain decoding token for token: with the lookup branch and without,
    on every tree the graphs hold."""
    loaded = load(artifact, backend)
    rules = StopRules(24)
    sampling = SamplingConfig(temperature=0.8, top_k=30, top_p=0.95)
    lookup_tree = TreeSpec(TREES[0].paths, lookup=(1, 1, 1))
    accepted = Counter()
    for seed, ids in enumerate(prompts(2, seed=6) + [ids * 2 for ids in prompts(1, seed=7)]):
        plain = generate(loaded.backend, ids, DecodeSettings("ar", rules, sampling=sampling, seed=seed))
        plain = plain.token_ids
        assert len(set(plain)) > 1
        for index, tree in enumerate((*TREES, lookup_tree)):
            settings = DecodeSettings("ss", rules, tree=tree, sampling=sampling, seed=seed)
            fast = generate(loaded.backend, ids, settings)
            assert fast.token_ids == plain
            accepted[index] += fast.run.new_tokens - fast.run.model_calls
    assert len(accepted) == 3 and all(count > 0 for count in accepted.values()), accepted  # the rule was exercised


@pytest.fixture(scope="module")
def shallow_checkpoint(tmp_path_factory):
    """Two layers, one of them multi-stream: quantized lowering time grows with the graph's size."""
    return write_checkpoint(tmp_path_factory.mktemp("shallow"), layers=2, msa_layers=1)


@pytest.fixture(scope="module")
def quantized(shallow_checkpoint, tmp_path_factory):
    """Each scheme's ExecuTorch artifact -> (manifest, folder), lowered at once: int8 here, 8da4w beside it."""
    out = tmp_path_factory.mktemp("quantized")

    def config(scheme: str) -> ExportConfig:  # one bucket: five methods to lower, not seven
        return ExportConfig(
            backends=("executorch",), buckets=(4,), capacity=128, prefill_chunk=16, quantize=scheme, parity_prompts=3
        )

    # DRAFT: a quantized head
    beside = build_beside(shallow_checkpoint / "ckpt", out / "8da4w", config("8da4w"), prompts(3), 24)
    here = build(shallow_checkpoint / "ckpt", out / "int8", config("int8"), prompts(3), 24)
    return {"int8": (here, out / "int8"), "8da4w": (beside.result(), out / "8da4w")}


@needs("executorch")
@pytest.mark.parametrize("scheme", ["int8", "8da4w"])
def test_quantized_executorch_stays_lossless_against_its_own_plain_decoding(quantized, scheme):
    data, out = quantized[scheme]
    assert data["graphs"]["quantize"]["executorch"] == scheme
    assert data["parity"]["executorch"]["ss_equals_own_plain"] == 3
    loaded = load(out, "executorch")
    for ids in prompts(4, seed=3):
        rules = StopRules(24)
        plain = generate(loaded.backend, ids, DecodeSettings("ar", rules)).token_ids
        ss = DecodeSettings("ss", rules, tree=loaded.tree)
        assert generate(loaded.backend, ids, ss).token_ids == plain
