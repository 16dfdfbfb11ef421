"""Training: a tiny model's loss falls; an interrupted run resumes to the same weights."""

import dataclasses

import pytest
import torch

from streamfuse.adapters.checkpoint import load_checkpoint, save_checkpoint
from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.training import train as train_module
from streamfuse.training.config import TrainConfig
from streamfuse.training.data import collate, encode
from streamfuse.training.loss import streaming_loss
from streamfuse.training.tasks import get_task
from streamfuse.training.train import forward_batch, train

from conftest import make_tiny_llama, make_tiny_tokenizer, write_tiny_dialogsum

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0)
STREAMS = StreamConfig(num_streams=2, msa_layers=2)


@pytest.fixture
def items(tmp_path):
    task, tokenizer = get_task("dialogsum"), make_tiny_tokenizer()
    examples = task.load("train", write_tiny_dialogsum(tmp_path / "data"), limit=8)
    return [encode(task, tokenizer, ex, 64, 32) for ex in examples]


def fresh_model():
    return SpeculativeStreamingLM(add_lora(make_tiny_llama(), LORA), STREAMS)


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def losses(model, items):
    model.eval()
    batch = collate(items, pad_id=1)
    return {k: float(v) for k, v in streaming_loss(model, forward_batch(model, batch, True), batch).items()}


def test_tiny_model_loss_falls(items, tmp_path):
    model = fresh_model()
    before = losses(model, items)
    config = TrainConfig(epochs=8, learning_rate=5e-2, grad_accumulation=1, warmup_ratio=0.0, save_every=1000)
    result = train(model, items, config, tmp_path / "snap", pad_id=1, with_streams=True, label="tiny")
    after = losses(model, items)
    assert after["main"] < 0.7 * before["main"]
    assert after["stream_1"] < 0.9 * before["stream_1"]
    assert result.optimizer_steps == 64 and result.tokens == 8 * sum(len(i.input_ids) for i in items)


def test_learning_rates_per_parameter_group():
    streams = dataclasses.replace(STREAMS, init_rank=4, init_per_stream=True)
    model = SpeculativeStreamingLM(add_lora(make_tiny_llama(), LORA), streams)
    config = TrainConfig(learning_rate=1e-3, stream_lr_scale=20.0, init_lr_scale=2.0)
    rate_of = {id(p): group["lr"] for group in train_module._parameter_groups(model, config) for p in group["params"]}
    init = model.stream_init
    assert rate_of[id(init.identifiers)] == pytest.approx(2e-2)
    assert all(rate_of[id(p)] == pytest.approx(2e-2) for p in model.pruning_head.parameters())
    assert rate_of[id(init.down.weight)] == rate_of[id(init.up)] == pytest.approx(2e-3)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(rate_of[id(p)] == pytest.approx(1e-3) for p in lora)
    assert len(rate_of) == sum(p.requires_grad for p in model.parameters())


def test_interrupted_training_resumes_to_the_same_weights(items, tmp_path, monkeypatch):
    config = TrainConfig(epochs=2, learning_rate=1e-2, grad_accumulation=1, save_every=1)
    reference = fresh_model()
    train(reference, items, config, tmp_path / "ref", pad_id=1, with_streams=True, label="ref")

    calls = {"n": 0}
    real_loss = train_module.streaming_loss

    def crash_on_fifth_batch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(train_module, "streaming_loss", crash_on_fifth_batch)
    with pytest.raises(KeyboardInterrupt):
        train(fresh_model(), items, config, tmp_path / "run", pad_id=1, with_streams=True, label="run")
    monkeypatch.setattr(train_module, "streaming_loss", real_loss)
    resumed = fresh_model()
    result = train(resumed, items, config, tmp_path / "run", pad_id=1, with_streams=True, label="run")
    assert result.optimizer_steps == 16
    expected, got = trainable(reference), trainable(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("per_stream_f_eta", [False, True])
def test_checkpoint_round_trip(tiny_base_dir, tmp_path, per_stream_f_eta):
    model = fresh_model()
    if per_stream_f_eta:  # what the frozen self-distillation stage saves
        model.grow_stream_init(init_rank=4, per_stream=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    save_checkpoint(model, make_tiny_tokenizer(), tmp_path / "ckpt", str(tiny_base_dir), LORA, {"note": "x"})
    loaded, tokenizer, manifest = load_checkpoint(tmp_path / "ckpt")
    assert manifest["info"] == {"note": "x"} and tokenizer.eos_token == "<|im_end|>"
    batch = collate([dataclasses.replace(items_for_roundtrip(), id="r")], pad_id=1)
    with torch.no_grad():
        a = forward_batch(model.eval(), batch, True)
        b = forward_batch(loaded, batch, True)
    torch.testing.assert_close(b.hidden, a.hidden)
    torch.testing.assert_close(b.stream_hidden, a.stream_hidden)
    torch.testing.assert_close(b.pruning_hidden, a.pruning_hidden)
    merged, _, _ = load_checkpoint(tmp_path / "ckpt", merge_lora=True)
    with torch.no_grad():
        c = forward_batch(merged, batch, True)
    torch.testing.assert_close(c.hidden, a.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.stream_hidden, a.stream_hidden, atol=1e-5, rtol=1e-5)


def items_for_roundtrip():
    from streamfuse.training.data import Encoded

    return Encoded("r", [2, 4, 9, 12, 3, 2, 5, 20, 21, 3], prompt_len=7)


def test_checkpoint_of_another_format_is_rejected(tmp_path):
    from streamfuse.adapters.checkpoint import read_manifest

    (tmp_path / "streamfuse.json").write_text('{"format_version": 99}')
    with pytest.raises(ValueError, match="format_version 99"):
        read_manifest(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a streamfuse checkpoint"):
        read_manifest(tmp_path / "missing")
