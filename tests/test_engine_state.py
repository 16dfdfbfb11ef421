"""A loaded model after an engine call that raised: the next generation equals a fresh model's, and a call before the
reset is refused (a pending commit is never moved twice); at load, one call checks that the engine writes the host's
cache in place; ONNX Runtime stays on the providers that run streamfuse's ops. The graphs here are the exported
graphs' modules run by torch (the engine keeps the cache, as on ExecuTorch and ONNX Runtime); test_export.py runs
the same checks on both engines."""

import numpy as np
import pytest
import torch

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.export.graph import GraphShapes, graph_modules, graph_spec
from streamfuse.export.span_attention import span_model
from streamfuse.export.verify import EagerRunner
from streamfuse.runtime.backends.base import EngineError
from streamfuse.runtime.backends.runners import MissingBackend, OnnxRuntimeRunner
from streamfuse.runtime.backends.static_graph import StaticGraphBackend
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama

TREE = TreeSpec.full(3, 2)  # node 2 is stream 1's second rank: a path through it moves rows
PROMPT = [5, 9, 14, 3, 77, 41, 8, 8, 60, 2, 33]
SETTINGS = [
    DecodeSettings("ss", StopRules(12), tree=TREE),
    DecodeSettings("ss", StopRules(12), tree=TREE, sampling=SamplingConfig(temperature=1.0), seed=3),
    DecodeSettings("ar", StopRules(12)),
]
# Where a generation's call fails: (call number, whether the engine ran it first); calls 1-2 are the prefill's.
FAILURES = [(1, False), (2, True), (3, True), (5, False), (6, True)]


class InjectedFailure(Exception):
    pass


class Failing:
    """A session whose call number `at` raises: after the engine ran it (its moves and rows written) or before."""

    def __init__(self, session, at: int, ran: bool):
        self.session, self.at, self.ran, self.calls = session, at, ran, 0
        self.name = session.name

    def run(self, method, inputs):
        self.calls += 1
        if self.calls == self.at:
            if self.ran:
                self.session.run(method, inputs)
            raise InjectedFailure(f"call {self.at} ({method})")
        return self.session.run(method, inputs)


class Copying:
    """A session that hands the engine copies of its inputs, as a provider on another device would."""

    def __init__(self, session):
        self.session, self.name = session, "copying"

    def run(self, method, inputs):
        return self.session.run(method, [np.array(a, copy=True) for a in inputs])


def tokens(backend, settings: DecodeSettings) -> list[int]:
    return generate(backend, PROMPT, settings).token_ids


def fail_with_moves_pending(backend, ran: bool) -> None:
    """Prefill, a step whose committed path [0, 2] skips node 1 (the next call moves node 2's rows down), then that
    next call raises, having moved them (ran) or not."""
    backend.reset(64)
    backend.prefill(PROMPT, with_streams=False)
    backend.step([33, *range(10, 10 + TREE.num_nodes - 1)], TREE, with_streams=False)
    backend.commit([0, 2])
    real = backend.runner
    backend.runner = Failing(real, 1, ran)
    try:
        with pytest.raises(InjectedFailure):
            backend.step([45, *range(20, 20 + TREE.num_nodes - 1)], TREE, with_streams=False)
    finally:
        backend.runner = real


def check_recovery(backend, fresh) -> None:
    """The checks every engine passes (test_export.py runs them on ExecuTorch and ONNX Runtime): a call that raises,
    mid-step or mid-generation, leaves `backend` refusing calls until a reset and its next generation equal to that
    of `fresh` (a fresh load), greedy and sampled."""
    expected = [tokens(fresh, settings) for settings in SETTINGS]
    for ran in (True, False):
        fail_with_moves_pending(backend, ran)
        with pytest.raises(
            EngineError,
            match=r"last call \(step_15\) raised InjectedFailure, so its KV cache is "
            r"unknown; reset the backend",
        ):
            backend.step([45], None, with_streams=False)
        with pytest.raises(EngineError, match="reset the backend"):
            backend.commit([0])
        assert [tokens(backend, settings) for settings in SETTINGS] == expected
    real = backend.runner
    for at, ran in FAILURES:
        backend.runner = Failing(real, at, ran)
        with pytest.raises(InjectedFailure):
            tokens(backend, SETTINGS[0])
        backend.runner = real
        assert tokens(backend, SETTINGS[0]) == expected[0], (at, ran)


def engine_graphs(model, buckets=(TREE.num_nodes,)) -> tuple[EagerRunner, object]:
    """The span graphs (the engine keeps the cache) run by torch, and what the host knows of them."""
    span = span_model(model)
    shapes = GraphShapes(capacity=64, prefill_chunk=8, buckets=buckets, span=True)
    return EagerRunner(graph_modules(span, shapes)), graph_spec(span, shapes, ["deferred"])


@pytest.fixture(scope="module")
def model() -> SpeculativeStreamingLM:
    return SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2)).eval()


@torch.no_grad()
def test_a_failed_call_leaves_the_engine_cache_backend_usable_after_its_reset(model):
    session, spec = engine_graphs(model)
    assert spec.engine_cache
    check_recovery(StaticGraphBackend(session, spec), StaticGraphBackend(session, spec))


@torch.no_grad()
def test_a_failed_call_leaves_the_torch_backend_usable_after_its_reset(model):
    backend, fresh = TorchBackend(model, kernels="eager"), TorchBackend(model, kernels="eager")
    expected = tokens(fresh, SETTINGS[0])
    for at, ran in FAILURES:
        real = backend.runner
        backend.runner = Failing(real, at, ran)
        with pytest.raises(InjectedFailure):
            tokens(backend, SETTINGS[0])
        backend.runner = real
        with pytest.raises(EngineError, match="reset the backend"):
            backend.prefill(PROMPT, with_streams=False)
        assert tokens(backend, SETTINGS[0]) == expected


@torch.no_grad()
def test_the_load_check_passes_an_engine_that_writes_in_place_and_leaves_no_trace(model):
    session, spec = engine_graphs(model)
    checked = StaticGraphBackend.checked(session, spec)
    assert checked.length == 0 and not checked.keys.any() and not checked.values.any()
    assert tokens(checked, SETTINGS[0]) == tokens(StaticGraphBackend(session, spec), SETTINGS[0])


@torch.no_grad()
def test_an_engine_that_copies_its_inputs_is_refused_at_load_in_one_line(model):
    session, spec = engine_graphs(model)
    with pytest.raises(
        EngineError,
        match=r"^copying did not write the KV cache in place \(a one-token call at load "
        r"left the host's keys unchanged\): it copies its inputs",
    ) as caught:
        StaticGraphBackend.checked(Copying(session), spec)
    assert "\n" not in str(caught.value)
    unchecked = StaticGraphBackend(Copying(session), spec)  # what the check prevents: wrong tokens, no error
    assert tokens(unchecked, SETTINGS[0]) != tokens(StaticGraphBackend(session, spec), SETTINGS[0])


def test_host_cache_graphs_need_no_load_check(model):
    shapes = GraphShapes(capacity=64, prefill_chunk=8, buckets=(4,))
    spec = graph_spec(model, shapes, ["deferred"])
    assert not spec.engine_cache
    StaticGraphBackend.checked(Copying(None), spec)  # the host copies rows itself: nothing to call


@pytest.mark.parametrize("provider", ["CUDAExecutionProvider", "TensorrtExecutionProvider", "AzureExecutionProvider"])
def test_onnxruntime_stays_on_the_providers_that_run_our_ops(provider, tmp_path):
    with pytest.raises(
        MissingBackend,
        match=rf"^onnxruntime provider {provider} cannot run this model: streamfuse's "
        r"ops in it have kernels for CPUExecutionProvider only",
    ):
        OnnxRuntimeRunner(tmp_path / "model.onnx", provider=provider)
