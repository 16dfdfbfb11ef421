"""Eq. 5 against a hand computation on a toy batch."""

import torch

from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.training.data import IGNORE, Encoded, collate
from streamfuse.training.loss import stream_targets, streaming_loss
from streamfuse.training.train import forward_batch

from conftest import make_tiny_llama

ITEMS = [Encoded("a", [5, 6, 7, 8, 9, 10], prompt_len=3), Encoded("b", [11, 12, 13, 14], prompt_len=2)]


def test_collate_labels_and_anchors_table():
    batch = collate(ITEMS, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE] * 3 + [8, 9, 10], [IGNORE] * 2 + [13, 14] + [IGNORE] * 2]
    assert batch.anchors.tolist() == [[2, 3, 4], [1, 2, 0]]
    assert batch.anchor_valid.tolist() == [[True, True, True], [True, True, False]]
    assert stream_targets(batch.labels, batch.anchors, batch.anchor_valid, 1).tolist() == [
        [9, 10, IGNORE],
        [14, IGNORE, IGNORE],
    ]
    assert stream_targets(batch.labels, batch.anchors, batch.anchor_valid, 2).tolist() == [
        [10, IGNORE, IGNORE],
        [IGNORE] * 3,
    ]


@torch.no_grad()
def test_loss_matches_hand_computation():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=2, msa_layers=2))
    batch = collate(ITEMS, pad_id=0)
    out = forward_batch(model, batch, with_streams=True)
    terms = streaming_loss(model, out, batch, main_weight=1.0, stream_weight=0.1, pruning_weight=0.5)

    def nll(hidden, target):
        return -torch.log_softmax(model.logits(hidden), -1)[target]

    # (row, position, target): main stream at p predicts the token at p + 1.
    main = [(0, 2, 8), (0, 3, 9), (0, 4, 10), (1, 1, 13), (1, 2, 14)]
    # (row, anchor slot, target): stream j at anchor p predicts the token at p + 1 + j.
    stream1 = [(0, 0, 9), (0, 1, 10), (1, 0, 14)]
    stream2 = [(0, 0, 10)]
    expect_main = sum(nll(out.hidden[b, p], t) for b, p, t in main) / len(main)
    expect_s1 = sum(nll(out.stream_hidden[b, a, 0], t) for b, a, t in stream1) / len(stream1)
    expect_s2 = sum(nll(out.stream_hidden[b, a, 1], t) for b, a, t in stream2) / len(stream2)
    expect_prune = sum(nll(out.pruning_hidden[b, p], t) for b, p, t in main) / len(main)
    torch.testing.assert_close(terms["main"], expect_main)
    torch.testing.assert_close(terms["stream_1"], expect_s1)
    torch.testing.assert_close(terms["stream_2"], expect_s2)
    torch.testing.assert_close(terms["pruning"], expect_prune)
    torch.testing.assert_close(terms["total"], expect_main + 0.1 * (expect_s1 + expect_s2) + 0.5 * expect_prune)


@torch.no_grad()
def test_baseline_loss_is_next_token_only():
    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=2, msa_layers=2))
    batch = collate(ITEMS, pad_id=0)
    terms = streaming_loss(model, forward_batch(model, batch, with_streams=False), batch)
    assert set(terms) == {"main", "total"}
    torch.testing.assert_close(terms["total"], terms["main"])


@torch.no_grad()
def test_rows_without_main_loss_train_streams_only():
    """Self-distilled rows (main_loss False) leave the main term to the other rows; streams keep both."""
    import dataclasses

    model = SpeculativeStreamingLM(make_tiny_llama(), StreamConfig(num_streams=2, msa_layers=2))
    mixed = collate([ITEMS[0], dataclasses.replace(ITEMS[1], main_loss=False)], pad_id=0)
    assert mixed.main_loss.tolist() == [True, False]
    both = streaming_loss(model, forward_batch(model, mixed, with_streams=True), mixed)
    first = collate(ITEMS[:1], pad_id=0)
    alone = streaming_loss(model, forward_batch(model, first, with_streams=True), first)
    torch.testing.assert_close(both["main"], alone["main"])
    assert not torch.allclose(both["stream_1"], alone["stream_1"])  # row b's stream target counts
