"""adapters/masks.py: one additive convention for every mask, against literal tables."""

import torch

from streamfuse.adapters.masks import GRAPH_MASKED, additive, causal_mask, masked_value


def test_additive_is_zero_where_visible_and_the_fill_elsewhere():
    visible = torch.tensor([[True, False], [True, True]])
    assert additive(visible).tolist() == [[0.0, masked_value(torch.float32)], [0.0, 0.0]]
    assert additive(visible, fill=GRAPH_MASKED).tolist() == [[0.0, -30000.0], [0.0, 0.0]]
    assert additive(visible, torch.float16).dtype == torch.float16


def test_the_graph_fill_survives_fp16_and_softmax_gives_it_nothing():
    assert torch.isfinite(torch.tensor(GRAPH_MASKED, dtype=torch.float16))
    assert torch.softmax(torch.tensor([3.0, 3.0 + GRAPH_MASKED]), -1).tolist() == [1.0, 0.0]


def test_causal_mask_hides_the_future_and_padded_keys():
    mask = causal_mask(torch.tensor([[1, 1, 0]]), past=1)  # one cached token, then two real and one pad
    seen = (mask[0, 0] == 0).int().tolist()
    assert seen == [
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 0],  # the padded query still sees earlier tokens: its row never goes NaN
    ]
