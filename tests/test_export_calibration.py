"""The build's acceptance statistics are what decoding sees, and the trees it exports."""

import pytest
import torch

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.runtime.speculation.calibration import BackendCalibration, TreeCost
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.calibration import acceptance_model, lookup_matches, position_ranks, tree_text, trees_to_export
from streamfuse.training.data import Encoded

from conftest import make_tiny_llama
from test_calibration import CHAIN, MODEL

# prompt 1 2 3 4 1 2 | answer 3 4 9 5: at root 3 lookup proposes 4 1 2 (after "1 2 3"), one right;
# at root 4 it proposes 1 2 3 (after "2 3 4"), none right; at root 9 it has nothing.
LOOKUPS = [
    ([1, 2, 3, 4, 1, 2, 3, 4, 9, 5], 6, 3, [1, 0, -1]),
    ([7, 8, 7, 8, 7, 8], 2, 2, [2, 2, 1]),
]  # a repeating answer: lookup continues it, cut by the end


@pytest.mark.parametrize("ids, prompt_len, depth, matches", LOOKUPS)
def test_lookup_matches_replay_prompt_lookup_along_the_answer(ids, prompt_len, depth, matches):
    assert lookup_matches(ids, prompt_len, depth) == matches


@torch.no_grad()
def test_teacher_forced_ranks_are_the_ranks_of_the_runtimes_drafts():
    model = SpeculativeStreamingLM(make_tiny_llama(seed=2), StreamConfig(num_streams=3, msa_layers=2)).eval()
    ids = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    item = Encoded("x", ids, prompt_len=12)
    rows = position_ranks(model, item, pad_id=0)
    assert len(rows) == len(ids) - item.prompt_len - 1
    backend = TorchBackend(model, stream_schedule="fused", kernels="eager")
    for offset, root in enumerate(range(item.prompt_len, len(ids) - 1)):
        backend.reset(len(ids))
        streams = backend.prefill(ids[:root], with_streams=True).stream_logits(0)  # drafts for root's children
        want = [
            int((streams[d - 1] > streams[d - 1, ids[root + d]]).sum()) if root + d < len(ids) else -1
            for d in (1, 2, 3)
        ]
        assert rows[offset] == want
    built = acceptance_model(model, [item], pad_id=0)
    assert built.positions == len(rows) and built.depth == 3


def test_exported_trees_are_this_machines_best_then_the_widest_then_for_low_bit_the_cheapest():
    best = MODEL.best_trees(16)
    calibration = BackendCalibration("cpu", 2, 0.01, (TreeCost(CHAIN, 0.014, 2.4, 2.4),), 0.002, 250.0)
    # 2.5 tokens, the most of any tree up to 8 nodes (the smallest that has them: 6 nodes)
    assert trees_to_export(MODEL, calibration, quantized=False, max_nodes=8) == [CHAIN, best[6], best[4]]
    assert best[6] == TreeSpec(((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))
    assert MODEL.expected_tokens(best[6]) == pytest.approx(2.5)
    assert trees_to_export(MODEL, calibration, quantized=True, max_nodes=8) == [CHAIN, best[6], best[2]]
    small = BackendCalibration("cpu", 2, 0.01, (TreeCost(best[2], 0.011, 1.6, 1.6),), 0.002, 250.0)
    assert trees_to_export(MODEL, small, quantized=True, max_nodes=8) == [best[2], best[6], best[4]]
    widest = BackendCalibration("cpu", 2, 0.01, (TreeCost(best[6], 0.011, 2.5, 2.5),), 0.002, 250.0)
    # once each where they coincide
    assert trees_to_export(MODEL, widest, quantized=False, max_nodes=8) == [best[6], best[4]]
    # ss-adaptive chooses per step: the cheap 2- and 4-node steps join, each once.
    cheap = trees_to_export(MODEL, calibration, quantized=False, max_nodes=8, cheap_trees=True)
    assert cheap == [CHAIN, best[6], best[4], best[2]]
    cheap = trees_to_export(MODEL, calibration, quantized=True, max_nodes=8, cheap_trees=True)
    assert cheap == [CHAIN, best[6], best[2], best[4]]
    assert TreeSpec.parse(tree_text(best[8])) == best[8] and TreeSpec.parse(tree_text(best[8])).lookup == (2, 0)
    # torch's choice larger than the graphs' largest bucket: its best calibrated tree that fits leads instead
    large = BackendCalibration(
        "cpu", 2, 0.01, (TreeCost(best[9], 0.012, 2.5, 2.5), TreeCost(best[4], 0.013, 2.0, 2.0)), 0.002, 250.0
    )
    assert trees_to_export(MODEL, large, quantized=False, max_nodes=8) == [best[4], best[6]]
