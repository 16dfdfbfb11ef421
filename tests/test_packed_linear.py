"""oneDNN-packed linear layers: the same function as nn.Linear, swapped in by module, lossless decoding."""

import pytest
import torch
from torch import nn

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export.eager import TorchBackend
from streamfuse.export.packed_linear import (
    ONE_ROW_PACKED_MIN_ELEMENTS,
    PackedLinear,
    packing_available,
    resolve_kernels,
)
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec

from conftest import make_tiny_llama

needs_onednn = pytest.mark.skipif(
    not packing_available("cpu", torch.float32),
    reason="this torch build has no oneDNN (mkldnn) CPU kernels to pack for",
)


def tiny_model(seed: int = 0) -> SpeculativeStreamingLM:
    return SpeculativeStreamingLM(make_tiny_llama(seed), StreamConfig(3, 2)).eval()


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (2, 48), (1, 7, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_linear_does(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        expected, got = linear(x), PackedLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_one_row_runs_the_original_kernel_bit_for_bit():
    linear = nn.Linear(48, 80)
    x = torch.randn(1, 1, 48)
    assert torch.equal(PackedLinear(linear)(x), linear(x))  # decoder layers: F.linear's gemv, unchanged


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3])
def test_head_sized_weights_run_packed_for_one_row_too(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, ONE_ROW_PACKED_MIN_ELEMENTS // 64, bias=False)
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.one_row_packed and not PackedLinear(nn.Linear(48, 80)).one_row_packed


@needs_onednn
def test_replace_linears_swaps_every_linear_and_the_lm_head():
    model = tiny_model()
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    ids = torch.randint(0, 97, (1, 6))
    positions = torch.arange(6)[None]
    mask = torch.zeros(1, 1, 6, 6).masked_fill(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), torch.finfo(torch.float32).min
    )
    with torch.inference_mode():
        before = model.logits(model(ids, positions, mask, anchors=torch.tensor([[5]])).hidden)
        assert model.replace_linears(PackedLinear) == linears > 0
        after = model.logits(model(ids, positions, mask, anchors=torch.tensor([[5]])).hidden)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.parts.lm_head, PackedLinear)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_kernel_choice():
    assert resolve_kernels("eager", "cpu", torch.float32) == "eager"
    assert resolve_kernels("auto", "cpu", torch.bfloat16) == "eager"
    assert resolve_kernels("auto", "cuda", torch.float32) == "eager"
    with pytest.raises(ValueError, match="kernels='eager'"):
        resolve_kernels("packed", "cuda", torch.float32)
    with pytest.raises(ValueError, match="auto, packed, eager"):
        resolve_kernels("fast", "cpu", torch.float32)
    if packing_available("cpu", torch.float32):
        assert resolve_kernels("auto", "cpu", torch.float32) == "packed"


@needs_onednn
def test_eager_kernels_leave_the_model_alone():
    backend = TorchBackend(tiny_model(), kernels="eager")
    assert backend.kernels == "eager" and isinstance(backend.model.parts.lm_head, nn.Linear)


@needs_onednn
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("schedule", ["fused", "deferred"])
def test_packed_speculative_equals_eager_plain(seed, schedule):
    """Lossless across kernels: SS on packed weights gives eager plain decoding's tokens."""
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    rules = StopRules(max_new_tokens=24, stop_token_ids=())
    plain = generate(TorchBackend(tiny_model(seed), kernels="eager"), prompt, DecodeSettings("ar", rules)).token_ids
    packed = TorchBackend(tiny_model(seed), stream_schedule=schedule, kernels="packed")
    assert packed.kernels == "packed"
    for tree in (TreeSpec.parse("gamma=3,k=1"), TreeSpec.parse("gamma=3,k=2")):
        assert generate(packed, prompt, DecodeSettings("ss", rules, tree=tree)).token_ids == plain


@needs_onednn
def test_packed_for_inference_generates_what_eager_does():
    """The build's evaluation and self-distillation generate on packed kernels: same greedy tokens."""
    from streamfuse.training.evaluation import packed_for_inference

    prompt = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        eager = make_tiny_llama(3).eval().generate(prompt, **settings)
        packed_model = packed_for_inference(make_tiny_llama(3).eval())
        packed = packed_model.generate(prompt, **settings)
    assert isinstance(packed_model.lm_head, PackedLinear)
    assert torch.equal(packed, eager)
    model = packed_for_inference(tiny_model())
    assert isinstance(model.parts.lm_head, PackedLinear)


def test_a_torch_without_the_private_onednn_ops_runs_eager(monkeypatch):
    from streamfuse import seams
    from streamfuse.export import packed_linear

    monkeypatch.setattr(seams, "MKLDNN_OPS", ("_reorder_linear_weight", "_no_such_op"))
    assert not packed_linear.packing_available("cpu", torch.float32)
    assert packed_linear.resolve_kernels("auto", "cpu", torch.float32) == "eager"
    with pytest.raises(ValueError, match="packed kernels need fp32 on a CPU with oneDNN"):
        packed_linear.resolve_kernels("packed", "cpu", torch.float32)
