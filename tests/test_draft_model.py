"""The draft model of two-model speculative decoding: the base's first layers, trained, driven by the runtime."""

import copy

import pytest
import torch

from streamfuse.adapters.config import LoraSettings
from streamfuse.adapters.hf import decoder_parts, keep_first_layers
from streamfuse.export.eager import TorchBackend
from streamfuse.methods.sd.drafter import ModelDrafter
from streamfuse.methods.sd.model import draft_model
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.config import TrainConfig
from streamfuse.training.data import Encoded
from streamfuse.training.train import train

from conftest import make_tiny_llama


@torch.no_grad()
def test_the_cut_model_is_the_first_layers_then_the_final_norm_and_head():
    full, cut = make_tiny_llama(2, layers=4), keep_first_layers(make_tiny_llama(2, layers=4), 2)
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    hidden = full(ids, output_hidden_states=True).hidden_states[2]  # the output of layer 2 (index 0: embeddings)
    parts = decoder_parts(full)
    expected = parts.lm_head(parts.norm(hidden))
    assert len(decoder_parts(cut).layers) == cut.config.num_hidden_layers == 2
    torch.testing.assert_close(cut(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [0, 5])
def test_a_cut_outside_the_stack_is_a_clear_error(layers):
    with pytest.raises(ValueError, match="keep 1..4 decoder layers"):
        keep_first_layers(make_tiny_llama(0, layers=4), layers)


def test_the_draft_model_learns_the_targets_answers_and_drafts_them(tmp_path):
    """Trained on one answer the target writes, the 2-layer draft model drafts it: SD equals plain
    decoding before and after, and accepts most drafts after. Only LoRA trains; the nominal stream never does."""
    target = TorchBackend(draft_model(make_tiny_llama(7, layers=4), 4, LoraSettings(rank=4)), kernels="eager")
    prompt = [3, 14, 15, 9, 2, 6]
    rules = StopRules(max_new_tokens=16)
    answer = generate(target, prompt, DecodeSettings("ar", rules)).token_ids
    torch.manual_seed(0)
    draft = draft_model(make_tiny_llama(7, layers=4), 2, LoraSettings(rank=8, dropout=0.0))
    streams = {k: v.clone() for k, v in draft.stream_init.state_dict().items()}
    settings = DecodeSettings("sd", rules, tree=TreeSpec.chain(3))

    def accepted(model) -> int:  # a backend freezes its model: give it a copy
        engine = TorchBackend(copy.deepcopy(model), kernels="eager")
        fast = generate(target, prompt, settings, drafter=ModelDrafter(engine, settings))
        assert fast.token_ids == answer
        return sum(step.accepted_depth for step in fast.run.steps)

    untrained = accepted(draft)
    config = TrainConfig(epochs=200, learning_rate=1e-2, grad_accumulation=1, warmup_ratio=0.0, save_every=1000)
    item = Encoded("a", prompt + answer, len(prompt))
    result = train(draft, [item], config, tmp_path / "snapshot", 0, with_streams=False, label="sd")
    assert result.final_losses["main"] < 0.5
    assert all(torch.equal(v, streams[k]) for k, v in draft.stream_init.state_dict().items())
    assert accepted(draft) >= max(untrained + 4, 10)  # of the 15 tokens after the prefill's
