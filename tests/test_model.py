"""SpeculativeStreamingLM: the main stream is the base model; streams follow eq. 2-3."""

import pytest
import torch

from streamfuse.adapters.config import LoraSettings, StreamConfig
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.masks import causal_mask
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.msa import StepKeyValues

from conftest import make_tiny_llama


def inputs(batch=2, tokens=9, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (batch, tokens), generator=generator)
    positions = torch.arange(tokens)[None].expand(batch, -1)
    return ids, positions, causal_mask(torch.ones(batch, tokens, dtype=torch.long))


@torch.no_grad()
def test_streams_off_is_exactly_the_base_model():
    base = make_tiny_llama()
    model = SpeculativeStreamingLM(base, StreamConfig(num_streams=3, msa_layers=2))
    ids, positions, mask = inputs()
    ours = model.logits(model(ids, positions, mask).hidden)
    assert torch.equal(ours, base(ids, attention_mask=mask).logits)
    torch.testing.assert_close(ours, base(ids).logits, atol=1e-6, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("stream_init", ["embedding", "value_rotation"])
def test_streams_on_leave_main_logits_equal_at_initialisation(stream_init):
    """LoRA at init (B = 0) plus streams: the main stream still computes the base model."""
    reference = make_tiny_llama()
    model = SpeculativeStreamingLM(
        add_lora(make_tiny_llama(), LoraSettings(rank=4)),
        StreamConfig(num_streams=3, msa_layers=2, stream_init=stream_init),
    )
    ids, positions, mask = inputs()
    out = model(ids, positions, mask, anchors=torch.tensor([[8, 3], [0, 8]]), with_pruning=True)
    # Stream columns are masked to exactly zero weight; only float summation order can differ.
    torch.testing.assert_close(model.logits(out.hidden), reference(ids).logits, atol=1e-5, rtol=0)
    assert out.stream_hidden.shape == (2, 2, 3, 32)
    assert out.pruning_hidden.shape == (2, 9, 32)


@torch.no_grad()
def test_streams_at_last_token_equal_a_causal_continuation():
    """With the anchor at the last token, eq. 2 is the same as appending the stream states as
    extra tokens at positions t+1..t+gamma under a plain causal mask (independent reference)."""
    base = make_tiny_llama()
    model = SpeculativeStreamingLM(base, StreamConfig(num_streams=3, msa_layers=2))
    ids, positions, mask = inputs(batch=1)
    out = model(ids, positions, mask, anchors=torch.tensor([[8]]))
    inner = base.model
    hidden = inner.embed_tokens(ids)
    for layer in inner.layers[:2]:
        hidden = layer(hidden, attention_mask=mask, position_embeddings=inner.rotary_emb(hidden, positions))
    hidden = torch.cat([hidden, hidden[:, -1:] + model.stream_init.identifiers[None]], dim=1)
    longer = torch.arange(12)[None]
    for layer in inner.layers[2:]:
        hidden = layer(
            hidden,
            attention_mask=causal_mask(torch.ones(1, 12, dtype=torch.long)),
            position_embeddings=inner.rotary_emb(hidden, longer),
        )
    torch.testing.assert_close(out.stream_hidden[0, 0], inner.norm(hidden)[0, 9:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_stream_does_not_see_later_tokens():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=2, msa_layers=2))
    ids, positions, mask = inputs(batch=1)
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 97
    anchors = torch.tensor([[4]])
    first = model(ids, positions, mask, anchors=anchors).stream_hidden
    second = model(changed, positions, mask, anchors=anchors).stream_hidden
    torch.testing.assert_close(first, second, atol=1e-6, rtol=0)


@torch.no_grad()
def test_past_key_values_continue_a_prefix_exactly_like_one_pass():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=2, msa_layers=2))
    ids, positions, mask = inputs(batch=1, tokens=9)
    whole = model(ids, positions, mask)
    prefix = model(ids[:, :6], positions[:, :6], causal_mask(torch.ones(1, 6, dtype=torch.long)))
    rest = model(
        ids[:, 6:],
        positions[:, 6:],
        causal_mask(torch.ones(1, 3, dtype=torch.long), past=6),
        key_values=StepKeyValues(4, 3, past=prefix.new_key_values),
    )
    torch.testing.assert_close(rest.hidden, whole.hidden[:, 6:], atol=1e-5, rtol=0)
    assert rest.new_key_values[0][0].shape == (1, 2, 3, 8)  # only the 3 new main tokens come back


def test_extra_parameter_count_matches_the_paper_formula():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2, pruning_rank=8))
    assert model.extra_parameters() == {"streams": 3 * 32, "pruning_head": 2 * 32 * 8, "total": 96 + 512}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_streams": 0}, "num_streams"),
        ({"msa_layers": 4}, "msa_layers"),
        ({"pruning_layer": 3}, "pruning_layer"),
        ({"stream_init": "magic"}, "stream_init"),
        ({"init_per_stream": True}, "init_per_stream needs init_rank"),
    ],
)
def test_bad_stream_config_is_rejected_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(**{"msa_layers": 2, **kwargs}))


@torch.no_grad()
def test_deferred_streams_equal_fused_streams():
    """Streams run after their anchor's K/V are cached see exactly what the fused pass shows them."""
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2))
    ids, positions, mask = inputs(batch=1)
    fused = model(ids, positions, mask, anchors=torch.tensor([[5]]))
    prefix = model.forward_lower(ids[:, :6], positions[:, :6], mask[:, :, :6, :6])
    cached = model.forward_upper(prefix).key_values.new
    deferred = model.forward_streams(
        prefix.hidden[:, 5:6], torch.tensor([[5]]), torch.zeros(1, 1, 1, 6), StepKeyValues(4, 0, past=cached)
    )
    torch.testing.assert_close(deferred[0, 0], fused.stream_hidden[0, 0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_growing_a_per_stream_f_eta_changes_nothing_until_it_trains():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2))
    ids, positions, mask = inputs()
    anchors = torch.tensor([[8, 3], [0, 8]])
    before = model(ids, positions, mask, anchors=anchors)
    identifiers = model.stream_init.identifiers.clone()
    model.grow_stream_init(init_rank=5, per_stream=True)
    assert model.config.init_rank == 5 and model.config.init_per_stream
    after = model(ids, positions, mask, anchors=anchors)
    assert torch.equal(after.stream_hidden, before.stream_hidden) and torch.equal(after.hidden, before.hidden)
    with pytest.raises(ValueError, match="without an f_eta"):
        model.grow_stream_init(init_rank=5, per_stream=True)

    # Trained, stream j gets its own residual block: S_j = M + U_j silu(D_j M) + P_j (eq. 3).
    init = model.stream_init
    init.up.normal_()
    anchor_hidden = torch.randn(2, 4, 32)
    streams = init(anchor_hidden)
    down = init.down.weight.reshape(3, 5, 32)
    for j in range(3):
        expected = anchor_hidden + torch.nn.functional.silu(anchor_hidden @ down[j].T) @ init.up[j] + identifiers[j]
        torch.testing.assert_close(streams[:, :, j], expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_shared_f_eta_is_one_linear_residual_for_every_stream():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=3, msa_layers=2, init_rank=4))
    init = model.stream_init
    init.up.normal_()
    anchor_hidden = torch.randn(1, 2, 32)
    shared = anchor_hidden + anchor_hidden @ init.down.weight.T @ init.up[0]
    torch.testing.assert_close(init(anchor_hidden), shared[:, :, None] + init.identifiers, atol=1e-5, rtol=1e-5)
