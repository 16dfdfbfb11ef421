"""Falcon: its CSGD training layout and the runtime's passes see the same rows, every engine's pass is the eager
one, and decoding with it is plain decoding's (greedy) or the target's distribution (sampling)."""

import math

import numpy as np
import pytest
import torch

from streamfuse.methods.falcon.drafter import FalconDrafter, block_visibility, top_path
from streamfuse.methods.falcon.graph import FalconPassModule, export_drafter, max_difference
from streamfuse.methods.falcon.graph_pass import GraphFalconPass
from streamfuse.methods.falcon.heldout import replay, tree_accepted
from streamfuse.methods.falcon.model import FalconModel, load_drafter, save_drafter
from streamfuse.methods.falcon.torch_pass import TorchFalconPass
from streamfuse.methods.falcon.train import (
    FalconTraining,
    _rank_in_group,
    falcon_layout,
    forward,
    glanced_inputs,
    pack,
    train_falcon,
)
from streamfuse.methods.fused.graph import EagerRunner
from streamfuse.methods.fused.train import IGNORE, answer_states
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from test_decode import backend_for, chi_square_p, exact_joint
from test_parallelspec import own_answers

# falcon_layout(4 real rows, k = 2, m = 2): rows r0..r3, then group t=1 (block 1: p0 p1, block 2: p2 p3) and group
# t=2 (block 1: p1 p2, block 2: p3). Columns: the answer index each row reads, the one it learns, the row whose
# prediction feeds it, and what it sees (1: visible) in that row order.
LAYOUT = (
    [0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3],
    [IGNORE] * 4 + [2, 3, IGNORE, IGNORE, 3, IGNORE, IGNORE],
    [-1] * 4 + [-1, -1, 4, 5, -1, -1, 8],
    [
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # r0..r3: causal
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # t=1 block 1: the real rows up to t (its own block's keys)
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0],  # t=1 block 2: those and all of block 2
        [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # t=2 block 1
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1],
    ],  # t=2 block 2 (cut short by the answer's end)
)

# block_visibility(slot 1 of 2 slots, 3 real of 4 rows, k = 2): slots s0 s1 | r0 r1 r2 pad.
BLOCK = [
    [1, 0, 1, 0, 0, 0],  # r0: slots below 1, itself
    [1, 0, 1, 1, 1, 0],  # r1, r2: the block, each sees the other
    [1, 0, 1, 1, 1, 0],
    [0, 0, 0, 0, 0, 1],
]  # pad: itself only


def test_falcon_layout_table():
    layout = falcon_layout(4, 2, 2)
    assert layout.inputs.tolist() == LAYOUT[0] and layout.targets.tolist() == LAYOUT[1]
    assert layout.feeder.tolist() == LAYOUT[2] and layout.visible.int().tolist() == LAYOUT[3]


def test_block_visibility_table():
    assert block_visibility(1, 2, 3, 4, 2).astype(int).tolist() == BLOCK


def test_rank_in_group_table():
    assert _rank_in_group(torch.tensor([3, 3, 3, 5, 7, 7])).tolist() == [0, 1, 2, 0, 0, 1]


def drafter_for(backend, block: int = 2, noise: float = 0.0, seed: int = 0, vocab=None) -> FalconModel:
    torch.manual_seed(seed)
    ids = torch.arange(backend.vocab_size) if vocab is None else torch.tensor(vocab)
    drafter = FalconModel.like(backend.model.model, ids, block)
    with torch.no_grad():
        for parameter in drafter.layer.parameters():
            parameter.add_(torch.randn_like(parameter) * noise)
    return drafter


def torch_pass(backend, drafter) -> TorchFalconPass:
    return TorchFalconPass(drafter, backend.model.parts.embed, backend.vocab_size)


def test_the_training_layout_gives_the_runtime_passes_outputs():
    """Group t's blocks, their later blocks fed the drafter's own predictions (CSGD with nothing glanced), are the
    runtime's passes at the step whose last real row is t."""
    backend = backend_for(4)
    drafter, embed = drafter_for(backend, noise=0.3), backend.model.parts.embed
    states, answer = torch.randn(6, 32), [7, 3, 9, 11, 2, 40]
    packed = pack([(states, answer)], 2, 3, 0.0)
    predicted, logits = forward(drafter, embed, packed, *glanced_inputs(drafter, embed, packed, 3, 0.0))
    layout, engine = falcon_layout(6, 2, 3), torch_pass(backend, drafter)
    for t in (1, 3):
        engine.reset()
        features, out = engine.run(states[: t + 1].numpy(), answer[: t + 1], 40, 0)
        for block in (1, 2, 3):
            rows = (
                (
                    (layout.group == t)
                    & (layout.inputs >= t - 1 + 2 * (block - 1))
                    & (layout.inputs <= t + 2 * (block - 1))
                )
                .nonzero()
                .flatten()
            )
            np.testing.assert_allclose(out[: len(rows)], logits[rows].detach().numpy(), atol=1e-4)
            np.testing.assert_allclose(features[: len(rows)], predicted[rows].detach().numpy(), atol=1e-4)
            top = drafter.vocab_ids[torch.as_tensor(out).argmax(-1)].tolist()
            slot = t + 1 + 2 * (block - 1)
            features, out = engine.run(features, top, 40 + slot, slot)


def test_glancing_gives_back_the_truth_to_the_first_mispredicted_inputs():
    """share 1: each group's first n fed inputs get the truth back, n its mispredicted inputs; share 0: none."""
    backend = backend_for(4)
    drafter, embed = drafter_for(backend, noise=0.5), backend.model.parts.embed
    packed = pack([(torch.randn(9, 32), [7, 3, 9, 11, 2, 40, 8, 1, 6])], 2, 3, 0.0)
    fed = packed.feeder >= 0
    _, predicted = glanced_inputs(drafter, embed, packed, 3, 0.0)
    _, glanced = glanced_inputs(drafter, embed, packed, 3, 1.0)
    for group in packed.group[fed].unique().tolist():
        rows = (fed & (packed.group == group)).nonzero().flatten()
        wrong = int((predicted[rows] != packed.tokens[rows]).sum())
        assert glanced[rows[:wrong]].tolist() == packed.tokens[rows[:wrong]].tolist()
        assert glanced[rows[wrong:]].tolist() == predicted[rows[wrong:]].tolist()
    assert not torch.equal(predicted[fed], packed.tokens[fed])  # the untrained drafter mispredicts some


def test_a_tree_without_its_top_path_or_deeper_than_the_graphs_scratch_is_a_one_line_error():
    backend = backend_for(3)
    engine = torch_pass(backend, drafter_for(backend))
    with pytest.raises(ValueError, match="rank-0 path"):
        top_path(TreeSpec.parse("[[1],[1,0]]"))
    with pytest.raises(ValueError, match="depth <= 4"):
        FalconDrafter(engine, TreeSpec.chain(5), SamplingConfig(), 0, max_passes=2)


@pytest.mark.parametrize(
    "block,tree",
    [
        (2, TreeSpec.chain(4)),
        (2, TreeSpec.full(3, 2)),
        (1, TreeSpec.full(2, 2)),
        (3, TreeSpec.parse("[[0],[1],[0,0],[0,0,0],[0,0,0,0]]")),
    ],
)
@pytest.mark.parametrize("noise", [0.0, 0.5])
def test_greedy_falcon_equals_plain_greedy(block, tree, noise):
    backend = backend_for(3, schedule="deferred")
    engine = torch_pass(backend, drafter_for(backend, block, noise=noise))
    rules = StopRules(max_new_tokens=30, stop_token_ids=(5,))
    for prompt in ([4, 8, 15, 16], [23, 42]):
        plain = generate(backend, prompt, DecodeSettings("ar", rules))
        settings = DecodeSettings("falcon", rules, tree=tree)
        fast = generate(backend, prompt, settings, drafter=FalconDrafter(engine, tree, settings.sampling, 0))
        assert (fast.token_ids, fast.stop_reason) == (plain.token_ids, plain.stop_reason)
        # a run's first k - 1 steps are plain (fewer real rows than a block), then m passes a step
        assert fast.run.plain_calls == block - 1
        assert fast.run.draft_calls == math.ceil(tree.depth / block) * len(fast.run.steps)


def eager_graph(backend, drafter, rows: int = 4, slots: int = 64, embedding=None) -> GraphFalconPass:
    table = backend.model.parts.embed.weight.detach().numpy() if embedding is None else embedding
    return GraphFalconPass(
        EagerRunner(FalconPassModule(drafter.eval(), rows)),
        table,
        drafter.vocab_ids.numpy(),
        drafter.block,
        rows,
        slots,
        (2, 8),
        backend.vocab_size,
    )


def test_the_static_pass_with_pad_rows_and_chunks_equals_the_torch_pass():
    """The graph layout (R rows padded, a C-slot cache, more rows than R in two calls, blocks in scratch slots)
    gives the dynamic pass's states and logits."""
    backend = backend_for(4)
    drafter = drafter_for(backend, noise=0.3)
    error = max_difference(eager_graph(backend, drafter, rows=3), torch_pass(backend, drafter), 32, 97, steps=6)
    assert error < 1e-5


def test_greedy_falcon_on_the_static_pass_equals_plain_greedy():
    backend = backend_for(3, schedule="deferred")
    engine = eager_graph(backend, drafter_for(backend, noise=0.5))
    rules, tree = StopRules(max_new_tokens=40, stop_token_ids=(5,)), TreeSpec.full(3, 2)
    for prompt in ([4, 8, 15, 16], [23, 42]):
        plain = generate(backend, prompt, DecodeSettings("ar", rules))
        settings = DecodeSettings("falcon", rules, tree=tree)
        assert (
            generate(backend, prompt, settings, drafter=FalconDrafter(engine, tree, settings.sampling, 0)).token_ids
            == plain.token_ids
        )


@pytest.mark.parametrize("engine", ["onnxruntime", "executorch"])
def test_the_exported_pass_matches_eager_and_decodes_plain_greedy(engine, tmp_path):
    pytest.importorskip(
        {"onnxruntime": "onnxruntime", "executorch": "executorch.runtime"}[engine], reason=f"{engine} is not installed"
    )
    backend = backend_for(3, schedule="deferred")
    drafter = drafter_for(backend, noise=0.5, vocab=list(range(0, 97, 2)))
    entry = export_drafter(drafter, backend.model.parts.embed, 4, 64, 3, [engine], tmp_path)
    assert entry["parity"][engine] <= 1e-4 and (entry["vocab"], entry["slots"]) == (49, 68)
    graph = GraphFalconPass.open(tmp_path, entry, engine, backend.vocab_size, threads=1)
    assert max_difference(graph, eager_graph(backend, drafter, slots=68, embedding=graph.embedding), 32, 97) < 1e-4
    rules, tree = StopRules(max_new_tokens=30, stop_token_ids=(5,)), TreeSpec.full(3, 2)
    plain = generate(backend, [4, 8, 15], DecodeSettings("ar", rules))
    settings = DecodeSettings("falcon", rules, tree=tree)
    fast = generate(backend, [4, 8, 15], settings, drafter=FalconDrafter(graph, tree, settings.sampling, 0, 3))
    assert fast.token_ids == plain.token_ids


def joint_counts(backend, engine, runs):
    counts = torch.zeros(8, 8)
    for seed in range(runs):
        settings = DecodeSettings(
            "falcon", StopRules(2), tree=TreeSpec.full(2, 2), sampling=SamplingConfig(1.0), seed=seed
        )
        tokens = generate(
            backend, [1, 2], settings, drafter=FalconDrafter(engine, settings.tree, settings.sampling, seed)
        ).token_ids
        counts[tokens[0], tokens[1]] += 1
    return counts


def test_sampled_falcon_matches_the_target_distribution():
    """2000 samples of (x1, x2) over 8 tokens, k = 1 so depth 2 comes from a second pass fed the drawn top
    token: chi-square against the exact target (the control is test_parallelspec's)."""
    backend = backend_for(5, vocab=8, gamma=2)
    exact = exact_joint(backend, SamplingConfig(temperature=1.0))
    engine = torch_pass(backend, drafter_for(backend, block=1, noise=0.5))
    assert chi_square_p(joint_counts(backend, engine, 2000), exact) > 1e-3


def tokens_per_step(backend, engine, prompts, tree) -> float:
    rules, total, steps = StopRules(max_new_tokens=24), 0, 0
    for prompt in prompts:
        settings = DecodeSettings("falcon", rules, tree=tree)
        result = generate(backend, prompt, settings, drafter=FalconDrafter(engine, tree, settings.sampling, 0))
        total, steps = total + len(result.token_ids), steps + len(result.run.steps)
    return total / steps


def test_training_on_the_targets_own_answers_raises_tokens_per_step(tmp_path):
    """A drafter trained with CSGD on the target's own greedy answers drafts them: more tokens per step than the
    untrained one on the same prompts, and it survives a save and load."""
    backend = backend_for(6, schedule="deferred")
    generator = np.random.default_rng(0)
    prompts = [generator.integers(6, 97, 6).tolist() for _ in range(24)]
    items = own_answers(backend, prompts)
    states = answer_states(backend.model, items, tmp_path / "states.safetensors")
    drafter, tree = drafter_for(backend), TreeSpec.chain(4)
    before = tokens_per_step(backend, torch_pass(backend, drafter), prompts[:8], tree)
    result = train_falcon(
        drafter,
        backend.model.parts.embed,
        items,
        states,
        FalconTraining(epochs=30, learning_rate=3e-3, items=4, distill_weight=1.0),
    )
    save_drafter(drafter, tmp_path / "drafter", {"training_key": "t"})
    loaded = load_drafter(tmp_path / "drafter", backend.model.model)
    after = tokens_per_step(backend, torch_pass(backend, loaded), prompts[:8], tree)
    print(before, after, result["final_losses"])
    assert after > before + 0.3, (before, after, result["final_losses"])


# tree_accepted: drafted tokens per depth (best first), the target's tokens, the tree's widths -> accepted tokens.
ACCEPTED = [
    ({1: [5, 6], 2: [7, 8]}, [5, 7], [1, 1], 2),  # the chain matches to its end
    ({1: [5, 6], 2: [7, 8]}, [6, 9], [2, 1], 1),  # depth 1's sibling matches: it has no children
    ({1: [5, 6], 2: [7, 8]}, [6, 9], [1, 1], 0),  # a chain has no sibling to take
    ({1: [5, 6], 2: [7, 8]}, [5, 8], [1, 2], 2),  # depth 2's sibling
    ({1: [5, 6], 2: [7, 8]}, [5], [1, 1], 1),  # the answer ends first
    ({1: [5, 6]}, [5, 7], [1, 1], 1),  # nothing drafted at depth 2
]


@pytest.mark.parametrize("candidates, truth, widths, expected", ACCEPTED)
def test_tree_accepted_table(candidates, truth, widths, expected):
    assert tree_accepted(candidates, truth, widths) == expected


def test_the_held_out_replay_scores_deeper_chains_no_shorter():
    backend = backend_for(4)
    drafter, embed = drafter_for(backend, noise=0.3), backend.model.parts.embed
    generator = np.random.default_rng(0)
    pieces = [(torch.randn(12, 32), generator.integers(0, 97, 12).tolist()) for _ in range(3)]
    pieces.append((torch.randn(12, 32), [int(t) for t in drafter.vocab_ids[:12]]))
    result = replay(drafter, embed, pieces)
    chains = [result["chain"][m] for m in (1, 2, 3)]
    assert chains == sorted(chains) and len(result["top1"]) == 6
    assert all(result["trees"][tree] >= result["chain"][1] for tree in ("2-1-1-1", "2-1-1-1-1-1"))
