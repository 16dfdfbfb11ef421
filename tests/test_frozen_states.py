"""Frozen bottom states: starting above the frozen layers changes no output and no trained weight."""

import dataclasses

import pytest
import torch

from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.training.config import TrainConfig
from streamfuse.training.data import collate, encode
from streamfuse.training.frozen_states import FrozenStates
from streamfuse.training.tasks import get_task
from streamfuse.training.train import forward_batch, train

from conftest import make_tiny_llama, make_tiny_tokenizer, write_tiny_dialogsum

STREAMS = StreamConfig(num_streams=2, msa_layers=2)  # 4 layers: streams from layer 2


def model_with_lora(top_layers, seed=0, streams=STREAMS):
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, top_layers=top_layers)
    return SpeculativeStreamingLM(add_lora(make_tiny_llama(seed=seed), lora), streams)


@pytest.fixture
def items(tmp_path):
    task, tokenizer = get_task("dialogsum"), make_tiny_tokenizer()
    examples = task.load("train", write_tiny_dialogsum(tmp_path / "data"), limit=6)
    return [encode(task, tokenizer, ex, 48, 16) for ex in examples]


@pytest.mark.parametrize(
    "top_layers, pruning_layer, depth", [(None, None, 0), (3, None, 1), (2, None, 2), (1, None, 2), (1, 1, 1)]
)
def test_frozen_depth_stops_at_trainable_layers_and_at_what_heads_read(top_layers, pruning_layer, depth):
    streams = dataclasses.replace(STREAMS, pruning_layer=pruning_layer)
    assert model_with_lora(top_layers, streams=streams).frozen_depth() == depth


def test_starting_from_bottom_states_gives_the_same_outputs(items):
    model = model_with_lora(2).eval()
    batch = collate(items[:3], pad_id=1)  # padded rows: states of padding positions are zeros
    bottom = FrozenStates().bottom(model, batch)
    assert bottom.depth == 2
    with torch.no_grad():
        full, resumed = forward_batch(model, batch, True), forward_batch(model, batch, True, bottom)
    real = batch.padding.bool()
    torch.testing.assert_close(resumed.hidden[real], full.hidden[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(resumed.pruning_hidden[real], full.pruning_hidden[real], rtol=1e-5, atol=1e-5)
    valid = batch.anchor_valid
    torch.testing.assert_close(resumed.stream_hidden[valid], full.stream_hidden[valid], rtol=1e-5, atol=1e-5)


def test_a_bottom_state_above_the_pruning_layer_is_refused(items):
    model = model_with_lora(1)  # frozen up to layer 2, where streams start
    batch = collate(items[:1], pad_id=1)
    bottom = FrozenStates().bottom(model, batch)
    shallow = model_with_lora(1, streams=dataclasses.replace(STREAMS, pruning_layer=1))
    with pytest.raises(ValueError, match="pruning head"):
        forward_batch(shallow, batch, True, bottom)


@pytest.mark.parametrize("budget", [2**30, 0])
def test_training_on_stored_states_gives_the_same_weights(items, tmp_path, budget, monkeypatch):
    config = TrainConfig(epochs=2, learning_rate=1e-2, grad_accumulation=2, save_every=1000)
    reference = model_with_lora(2)
    train(reference, items, config, tmp_path / "ref", pad_id=1, with_streams=True, label="ref")

    states, computed = FrozenStates(budget), {"rows": 0}
    real_bottom = SpeculativeStreamingLM.forward_bottom

    def counting(self, *args, **kwargs):
        computed["rows"] += 1
        return real_bottom(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeStreamingLM, "forward_bottom", counting)
    stored = model_with_lora(2)
    train(stored, items, config, tmp_path / "stored", pad_id=1, with_streams=True, label="stored", states=states)
    for name, value in reference.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(dict(stored.named_parameters())[name], value, rtol=1e-5, atol=1e-6)
    # Two epochs: each row's bottom is computed once when stored, every time when over budget.
    assert computed["rows"] == (len(items) if budget else 2 * len(items))
    assert len(states) == (len(items) if budget else 0)


def test_models_share_states_only_when_their_bottom_layers_are_equal(items):
    states, batch = FrozenStates(), collate(items[:1], pad_id=1)
    states.bottom(model_with_lora(2), batch)
    states.bottom(model_with_lora(2), batch)  # a baseline on the same base: same bottom
    assert len(states) == 1
    states.bottom(model_with_lora(2, seed=1), batch)  # another base model
    states.bottom(model_with_lora(3), batch)  # the same base, a shallower frozen part
    assert len(states) == 3
