"""Multi-stream attention mask and key/value provider, checked against literal tables."""

import torch

from streamfuse.adapters.masks import causal_mask, multi_stream_mask, stream_block
from streamfuse.adapters.msa import StepKeyValues

X = torch.finfo(torch.float32).min


def allowed(mask: torch.Tensor) -> list[list[int]]:
    return (mask == 0).int().tolist()


def test_stream_block_table():
    # anchors a0, a1 with streams s1, s2 each: rows/cols a0s1 a0s2 a1s1 a1s2
    assert allowed(stream_block(2, 2, torch.float32)) == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 0, 1, 1],
    ]


def test_multi_stream_mask_table():
    """3 main tokens (causal), streams (gamma=2) at tokens 0 and 2."""
    main = causal_mask(torch.ones(1, 3, dtype=torch.long))
    mask = multi_stream_mask(main, torch.tensor([[0, 2]]), num_streams=2)
    # columns: m0 m1 m2 | t0s1 t0s2 t2s1 t2s2
    assert allowed(mask[0, 0]) == [
        [1, 0, 0, 0, 0, 0, 0],  # m0
        [1, 1, 0, 0, 0, 0, 0],  # m1
        [1, 1, 1, 0, 0, 0, 0],  # m2
        [1, 0, 0, 1, 0, 0, 0],  # stream 1 at m0: sees m0 and itself
        [1, 0, 0, 1, 1, 0, 0],  # stream 2 at m0: sees m0, stream 1, itself
        [1, 1, 1, 0, 0, 1, 0],  # stream 1 at m2
        [1, 1, 1, 0, 0, 1, 1],  # stream 2 at m2
    ]
    assert mask.dtype == torch.float32 and float(mask.min()) == X


def test_multi_stream_mask_with_past_and_padding():
    """Past columns follow the anchor's own row; padded keys stay masked for streams too."""
    main = causal_mask(torch.tensor([[1, 1, 0]]), past=2)
    mask = multi_stream_mask(main, torch.tensor([[1]]), num_streams=1)
    # columns: p0 p1 m0 m1 m2(pad) | m1s1
    assert allowed(mask[0, 0]) == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 1],
    ]


def test_step_key_values_keeps_only_main_tokens():
    past = [(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))]
    keys, values = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    kv = StepKeyValues(num_layers=1, main_len=3, past=past)
    all_keys, all_values = kv.update(keys, values, 0)
    assert all_keys.shape == (1, 2, 9, 8)
    assert torch.equal(all_keys[:, :, 4:], keys) and torch.equal(all_values[:, :, 4:], values)
    assert torch.equal(kv.new[0][0], keys[:, :, :3]) and kv.new[0][1].shape == (1, 2, 3, 8)


def test_value_rotation_turns_only_stream_values():
    values = torch.randn(1, 1, 4, 8)
    angles = torch.tensor([0.5, 1.0])
    kv = StepKeyValues(num_layers=1, main_len=2)
    kv.value_angles = angles
    _, rotated = kv.update(torch.randn(1, 1, 4, 8), values, 0)
    assert torch.equal(rotated[:, :, :2], values[:, :, :2])
    # A rotation keeps each (x_i, x_{i+d/2}) pair's norm and turns it by the stream's angle.
    first, turned = values[0, 0, 2], rotated[0, 0, 2]
    a = torch.complex(first[:4], first[4:])
    b = torch.complex(turned[:4], turned[4:])
    torch.testing.assert_close(b, a * torch.exp(torch.tensor(0.5j)), atol=1e-6, rtol=1e-6)
