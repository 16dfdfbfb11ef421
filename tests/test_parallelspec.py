"""ParallelSpec: its training layout and the runtime's pass see the same rows, every engine's pass is the eager
one, and decoding with it is plain decoding's (greedy) or the target's distribution (sampling)."""

import numpy as np
import pytest
import torch

from streamfuse.methods.fused.graph import EagerRunner
from streamfuse.methods.fused.train import IGNORE, AnswerStates, answer_states, embed_scale, vocab_columns
from streamfuse.methods.parallelspec.drafter import ParallelDrafter, pass_visibility
from streamfuse.methods.parallelspec.graph import DraftPass, export_drafter, max_difference
from streamfuse.methods.parallelspec.graph_pass import GraphParallelPass
from streamfuse.methods.parallelspec.model import ParallelSpecModel, load_drafter, save_drafter
from streamfuse.methods.parallelspec.torch_pass import TorchParallelPass
from streamfuse.methods.parallelspec.train import DrafterTraining, group_layout, packed_logits, train_drafter
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.accept import accept_sampled
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.data import Encoded

from test_decode import backend_for, chi_square_p, exact_joint

# group_layout(2 real rows, 2 masks): rows r0 r1 | (0,1) (0,2) (1,1) (1,2) -> position offsets, the answer index
# each row learns, and what each row sees (1: visible), in that row order.
GROUPS = (
    [0, 1, 1, 2, 2, 3],
    [1, 2, 2, 3, 3, 4],
    [
        [1, 0, 0, 0, 0, 0],  # r0
        [1, 1, 0, 0, 0, 0],  # r1
        [1, 0, 1, 0, 0, 0],  # [MASK]_1 of r0
        [1, 0, 1, 1, 0, 0],  # [MASK]_2 of r0
        [1, 1, 0, 0, 1, 0],  # [MASK]_1 of r1
        [1, 1, 0, 0, 1, 1],
    ],  # [MASK]_2 of r1
)

# pass_visibility(cached 1 of 2 slots, 1 real of 2 rows, 2 masks): slots s0 s1 | r0 pad | m1 m2.
PASS = [
    [1, 0, 1, 0, 0, 0],  # r0: the cached row and itself
    [0, 0, 0, 1, 0, 0],  # the pad row: itself only
    [1, 0, 1, 0, 1, 0],  # [MASK]_1
    [1, 0, 1, 0, 1, 1],
]  # [MASK]_2


def test_group_layout_table():
    offsets, labels, visible = group_layout(2, 2)
    assert offsets.tolist() == GROUPS[0] and labels.tolist() == GROUPS[1]
    assert visible.int().tolist() == GROUPS[2]


def test_pass_visibility_table():
    assert pass_visibility(1, 2, 1, 2, 2).astype(int).tolist() == PASS


def drafter_for(backend, masks: int = 2, noise: float = 0.0, seed: int = 0, vocab=None) -> ParallelSpecModel:
    torch.manual_seed(seed)
    model = backend.model.model
    ids = torch.arange(backend.vocab_size) if vocab is None else torch.tensor(vocab)
    drafter = ParallelSpecModel.like(model, ids, masks)
    with torch.no_grad():
        for parameter in drafter.layer.parameters():
            parameter.add_(torch.randn_like(parameter) * noise)
    return drafter


def torch_pass(backend, drafter) -> TorchParallelPass:
    return TorchParallelPass(drafter, backend.model.parts.embed, backend.vocab_size)


def test_the_training_layout_gives_the_runtime_passes_logits():
    """Group t of the packed training sequence = a runtime pass whose last real row is t, after earlier passes
    filled the cache (positions shifted: rotary attention sees offsets only)."""
    backend = backend_for(4)
    drafter, embed = drafter_for(backend, noise=0.3), backend.model.parts.embed
    states, answer = torch.randn(5, 32), [7, 3, 9, 11, 2]
    logits, labels, rank = packed_logits(drafter, embed, [(states, answer)])
    engine = torch_pass(backend, drafter)
    engine.reset()
    for first, last in [(0, 1), (2, 2), (3, 4)]:
        out = engine.run(states[first : last + 1].numpy(), answer[first : last + 1], 40 + first)
        group = 5 + last * 2  # the masks of group `last` in the packed rows
        expected = torch.cat([logits[last : last + 1], logits[group : group + 2]])
        np.testing.assert_allclose(out, expected.detach().numpy(), atol=1e-4)
    assert labels[:5].tolist() == [3, 9, 11, 2, IGNORE] and rank.tolist() == [0] * 5 + [1, 2] * 5


def test_the_fused_input_starts_as_the_state_plus_the_scaled_embedding():
    backend = backend_for(4)
    drafter, embed = drafter_for(backend), backend.model.parts.embed
    states = AnswerStates(torch.randn(50, 32) * 3.0, torch.tensor([50]))
    scale = embed_scale(states, embed)
    assert scale == pytest.approx(
        float(states.hidden.pow(2).mean().sqrt() / embed.weight.pow(2).mean().sqrt()), rel=1e-5
    )
    drafter.start_fused(scale)
    h, e = torch.randn(3, 32), torch.randn(3, 32)
    torch.testing.assert_close(drafter.fuse(torch.cat([h, e], dim=-1)), h + scale * e)


def test_labels_outside_the_vocabulary_are_left_out():
    assert vocab_columns(torch.tensor([2, 5, 9]), torch.tensor([5, 3, 9, IGNORE, 2])).tolist() == [
        1,
        IGNORE,
        2,
        IGNORE,
        0,
    ]


@pytest.mark.parametrize("tree", [TreeSpec.chain(3), TreeSpec.full(2, 2), TreeSpec.parse("[[0],[1],[0,0],[0,0,0]]")])
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_greedy_parallelspec_equals_plain_greedy(tree, noise):
    backend = backend_for(3, schedule="deferred")
    engine = torch_pass(backend, drafter_for(backend, noise=noise))
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    for prompt in ([4, 8, 15, 16], [23, 42]):
        plain = generate(backend, prompt, DecodeSettings("ar", rules))
        settings = DecodeSettings("parallelspec", rules, tree=tree)
        fast = generate(backend, prompt, settings, drafter=ParallelDrafter(engine, tree, settings.sampling, 0))
        assert (fast.token_ids, fast.stop_reason) == (plain.token_ids, plain.stop_reason)
        assert fast.run.draft_calls == len(fast.run.steps)  # one pass per step, whatever the depth


def test_a_tree_deeper_than_one_pass_drafts_is_a_one_line_error():
    backend = backend_for(3)
    with pytest.raises(ValueError, match="depth <= 3"):
        ParallelDrafter(torch_pass(backend, drafter_for(backend)), TreeSpec.chain(4), SamplingConfig(), 0)


def eager_graph(backend, drafter, rows: int = 4, capacity: int = 64, embedding=None) -> GraphParallelPass:
    table = backend.model.parts.embed.weight.detach().numpy() if embedding is None else embedding
    return GraphParallelPass(
        EagerRunner(DraftPass(drafter.eval(), rows)),
        table,
        drafter.vocab_ids.numpy(),
        drafter.num_masks,
        rows,
        capacity,
        (2, 8),
        backend.vocab_size,
    )


def test_the_static_pass_with_pad_rows_and_chunks_equals_the_torch_pass():
    """The graph layout (R rows padded, a C-slot cache, more real rows than R in chunks) gives the dynamic pass's
    logits."""
    backend = backend_for(4)
    drafter = drafter_for(backend, noise=0.3)
    graph, dynamic = eager_graph(backend, drafter, rows=3), torch_pass(backend, drafter)
    graph.reset()
    dynamic.reset()
    generator, position = np.random.default_rng(1), 10
    for real in (1, 3, 2, 5, 1):  # 5 > R: two passes
        states = generator.standard_normal((real, 32)).astype(np.float32)
        tokens = generator.integers(0, 97, real).tolist()
        np.testing.assert_allclose(
            graph.run(states, tokens, position), dynamic.run(states, tokens, position), atol=1e-4
        )
        position += real


def test_greedy_parallelspec_on_the_static_pass_equals_plain_greedy():
    backend = backend_for(3, schedule="deferred")
    engine = eager_graph(backend, drafter_for(backend, noise=0.5))
    rules, tree = StopRules(max_new_tokens=40, stop_token_ids=(5,)), TreeSpec.full(3, 2)
    for prompt in ([4, 8, 15, 16], [23, 42]):
        plain = generate(backend, prompt, DecodeSettings("ar", rules))
        settings = DecodeSettings("parallelspec", rules, tree=tree)
        assert (
            generate(backend, prompt, settings, drafter=ParallelDrafter(engine, tree, settings.sampling, 0)).token_ids
            == plain.token_ids
        )


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("engine", ["onnxruntime", "executorch"])
def test_the_exported_pass_matches_eager_and_decodes_plain_greedy(engine, quantize, tmp_path):
    pytest.importorskip(
        {"onnxruntime": "onnxruntime", "executorch": "executorch.runtime"}[engine], reason=f"{engine} is not installed"
    )
    backend = backend_for(3, schedule="deferred")
    drafter = drafter_for(backend, noise=0.5, vocab=list(range(0, 97, 2)))
    entry = export_drafter(drafter, backend.model.parts.embed, 4, 64, [engine], tmp_path, quantize)
    assert entry["parity"][engine] <= 1e-4 and entry["vocab"] == 49
    assert entry["formats"] == {engine: quantize if engine == "executorch" else "none"}
    graph = GraphParallelPass.open(tmp_path, entry, engine, backend.vocab_size, threads=1)
    error = max_difference(graph, eager_graph(backend, drafter, embedding=graph.embedding), 32, 97)  # its fp16 table
    assert (error > 1e-3) == (quantize == "int8" and engine == "executorch")  # only ExecuTorch's int8 is quantized
    rules, tree = StopRules(max_new_tokens=30, stop_token_ids=(5,)), TreeSpec.full(3, 2)
    plain = generate(backend, [4, 8, 15], DecodeSettings("ar", rules))
    settings = DecodeSettings("parallelspec", rules, tree=tree)
    fast = generate(backend, [4, 8, 15], settings, drafter=ParallelDrafter(graph, tree, settings.sampling, 0))
    assert fast.token_ids == plain.token_ids


# Two siblings drawn without replacement from q, against p: the first emitted token must be distributed as p
# (recursive rejection sampling). q puts most mass where p has little, so rejections and the q update matter.
P, Q = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.5, 0.3, 0.15, 0.05])


def test_multi_draft_speculative_sampling_emits_the_target_distribution():
    generator, tree, counts = np.random.default_rng(0), TreeSpec.full(1, 2), np.zeros(4)
    for _ in range(20000):
        first = int(generator.choice(4, p=Q))
        rest = Q.copy()
        rest[first] = 0
        second = int(generator.choice(4, p=rest / rest.sum()))
        result = accept_sampled(tree, [9, first, second], np.stack([Q, Q, Q]), lambda n: P, generator)
        counts[[9, first, second][result.path[1]] if len(result.path) > 1 else result.correction] += 1
    np.testing.assert_allclose(counts / counts.sum(), P, atol=0.012)


def test_a_tree_of_drawn_drafts_stops_when_q_has_no_token_left():
    """q on one token, two children: the second child holds no draw and is never accepted."""
    q, p = np.array([1.0, 0.0, 0.0]), np.array([0.0, 0.5, 0.5])
    results = [
        accept_sampled(TreeSpec.full(1, 2), [9, 0, 0], np.stack([q, q, q]), lambda n: p, np.random.default_rng(s))
        for s in range(200)
    ]
    assert all(r.path == [0] and r.correction in (1, 2) for r in results)


def joint_counts(backend, engine, runs):
    counts = torch.zeros(8, 8)
    for seed in range(runs):
        settings = DecodeSettings(
            "parallelspec", StopRules(2), tree=TreeSpec.full(2, 2), sampling=SamplingConfig(1.0), seed=seed
        )
        tokens = generate(
            backend, [1, 2], settings, drafter=ParallelDrafter(engine, settings.tree, settings.sampling, seed)
        ).token_ids
        counts[tokens[0], tokens[1]] += 1
    return counts


def test_sampled_parallelspec_matches_the_target_distribution():
    """2000 samples of (x1, x2) over 8 tokens with a 2 x 2 tree of drawn siblings, chi-square against the exact
    target. Control: the drafter's own first-token distribution fails the same test."""
    backend = backend_for(5, vocab=8, gamma=2)
    drafter = drafter_for(backend, noise=0.5)
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_joint(backend, sampling)
    assert chi_square_p(joint_counts(backend, torch_pass(backend, drafter), 2000), exact) > 1e-3
    other = exact_joint(backend, SamplingConfig(temperature=1.6)).flatten()
    draws = torch.multinomial(other, 2000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert chi_square_p(torch.bincount(draws, minlength=64).float().view(8, 8), exact) < 1e-3


def own_answers(backend, prompts, tokens: int = 24) -> list[Encoded]:
    rules = StopRules(max_new_tokens=tokens)
    return [
        Encoded(f"x{i}", list(p) + generate(backend, p, DecodeSettings("ar", rules)).token_ids, len(p))
        for i, p in enumerate(prompts)
    ]


def tokens_per_step(backend, engine, prompts, tree) -> float:
    rules, total, steps = StopRules(max_new_tokens=24), 0, 0
    for prompt in prompts:
        settings = DecodeSettings("parallelspec", rules, tree=tree)
        result = generate(backend, prompt, settings, drafter=ParallelDrafter(engine, tree, settings.sampling, 0))
        total, steps = total + len(result.token_ids), steps + len(result.run.steps)
    return total / steps


def test_training_on_the_targets_own_answers_raises_tokens_per_step(tmp_path):
    """A drafter trained group-wise on the target's own greedy answers drafts them: more tokens per step than
    the untrained one on the same prompts, and it survives a save and load."""
    backend = backend_for(6, schedule="deferred")
    generator = np.random.default_rng(0)
    prompts = [generator.integers(6, 97, 6).tolist() for _ in range(24)]
    items = own_answers(backend, prompts)
    states = answer_states(backend.model, items, tmp_path / "states.safetensors")
    assert isinstance(states, AnswerStates) and states.lengths.tolist() == [
        len(i.input_ids) - i.prompt_len for i in items
    ]
    drafter, tree = drafter_for(backend, masks=2), TreeSpec.full(3, 2)
    before = tokens_per_step(backend, torch_pass(backend, drafter), prompts[:8], tree)
    result = train_drafter(
        drafter, backend.model.parts.embed, items, states, DrafterTraining(epochs=30, learning_rate=3e-3, items=4)
    )
    save_drafter(drafter, tmp_path / "drafter", {"training_key": "t"})
    loaded = load_drafter(tmp_path / "drafter", backend.model.model)
    after = tokens_per_step(backend, torch_pass(backend, loaded), prompts[:8], tree)
    print(before, after, result["final_losses"])
    assert after > before + 0.3, (before, after, result["final_losses"])
