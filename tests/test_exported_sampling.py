"""Sampling at T > 0 on ONNX Runtime itself: every method that verifies on the exported target draws from
the exact target distribution (chi-square), not only through eager-run graphs."""

import pytest
import torch
from test_decode import backend_for, chi_square_p, exact_joint
from test_specdec import constant_head
from test_tree_choice import random_head

from streamfuse.adapters.medusa import MedusaHeads
from streamfuse.runtime.calibration import AcceptanceModel, BackendCalibration, TreeCost
from streamfuse.runtime.decode import generate
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.model_drafter import ModelDrafter, StopRule
from streamfuse.runtime.sampling import SamplingConfig
from streamfuse.runtime.settings import DecodeSettings
from streamfuse.runtime.stream_drafter import AdaptiveStreamDrafter, HeadDrafter
from streamfuse.runtime.tree import TreeSpec
from streamfuse.runtime.tree_choice import TreeChoice

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TREES = (TreeSpec.chain(2), TreeSpec.full(2, 2), TreeSpec.chain(3))  # SS's two, and sd's chain


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A γ = 2 model over 8 tokens (and 2 Medusa heads) exported to one ONNX model, run by ONNX Runtime."""
    from streamfuse.export import graph
    from streamfuse.export.to_onnx import export_onnx
    from streamfuse.runtime.backends.sessions import OnnxRuntimeSession
    from streamfuse.runtime.backends.static_graph import StaticGraphBackend

    torch_target = backend_for(5, vocab=8, gamma=2, schedule="deferred")
    heads = MedusaHeads(2, 32)
    with torch.no_grad():
        for block in heads.blocks:
            block.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    model, shapes = torch_target.model, graph.GraphShapes(capacity=32, prefill_chunk=4, trees=TREES)
    schedules = ["deferred"] * len(TREES)
    modules = graph.graph_modules(model, shapes, None, schedules, heads)
    folder = tmp_path_factory.mktemp("onnx")
    names = graph.names_of(modules)
    model_file, _ = export_onnx(modules, graph.example_inputs(model, shapes), *names, folder)
    session = OnnxRuntimeSession(folder / model_file, threads=1)
    return torch_target, StaticGraphBackend(session, graph.graph_spec(model, shapes, schedules, heads=2))


def drafters(target):
    """method -> (its drafter, its longest tree), each verifying on the ONNX Runtime target."""
    acceptance = AcceptanceModel(4, 2, ((((0, 0), -1), ((1,), -1), ((), -1), ((0, 1), -1)),))
    calibration = BackendCalibration("test", 1, 1.0, tuple(TreeCost(t, c, 1.0, 1.0) for t, c in zip(TREES[:2], (1.3, 2.0))),
                                     0.001, 10.0)
    adaptive = AdaptiveStreamDrafter(TreeChoice.from_calibration(acceptance, calibration), random_head(1), 2)
    draft_model = backend_for(9, vocab=8, gamma=2)
    sd = DecodeSettings("sd", StopRules(3), tree=TREES[2])
    specdec = DecodeSettings("specdec++", StopRules(3), tree=TREES[2])
    return {"ss": (None, TREES[1]), "ss-adaptive": (adaptive, adaptive.tree), "medusa": (HeadDrafter(TREES[1], 2), TREES[1]),
            "sd": (ModelDrafter(draft_model, sd), TREES[2]),
            "specdec++": (ModelDrafter(draft_model, specdec, StopRule(constant_head(0.7), 0.5)), TREES[2])}


@pytest.mark.parametrize("method", ["ss", "ss-adaptive", "medusa", "sd", "specdec++"])
def test_each_method_samples_the_exact_target_on_onnx_runtime(exported, method):
    """1,000 runs at T = 1 of 3 new tokens (a second step follows the first's correction); (x1, x2) counted
    against the exact joint of the torch model the graphs came from."""
    torch_target, target = exported
    drafter, tree = drafters(target)[method]
    counts = torch.zeros(8, 8)
    for seed in range(1000):
        settings = DecodeSettings(method, StopRules(3), tree=tree, sampling=SamplingConfig(1.0), seed=seed)
        tokens = generate(target, [1, 2], settings, drafter=drafter).token_ids
        counts[tokens[0], tokens[1]] += 1
    assert chi_square_p(counts, exact_joint(torch_target, SamplingConfig(1.0))) > 1e-3
