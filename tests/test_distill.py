"""Self-distillation data: the model's own greedy answers, cached and resumable."""

import json

import pytest
import torch

from streamfuse.training import distill
from streamfuse.training.data import Encoded

from conftest import make_tiny_llama, make_tiny_tokenizer

PROMPTS = [
    "<|im_start|> user the time of day <|im_end|> <|im_start|> assistant",
    "<|im_start|> user people and words <|im_end|> <|im_start|> assistant",
    "<|im_start|> user one <|im_end|> <|im_start|> assistant",
]
IDS = ["a", "b", "c"]


@torch.no_grad()
def greedy_alone(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """Unbatched greedy decoding, one argmax at a time: the reference for the batched answers."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer: list[int] = []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids + answer])).logits[0, -1].argmax())
        answer.append(token)
        if token == tokenizer.eos_token_id:
            break
    return answer


def test_answers_are_the_models_greedy_continuations(tmp_path):
    model, tokenizer = make_tiny_llama().eval(), make_tiny_tokenizer()
    items = distill.self_distilled(model, tokenizer, IDS, PROMPTS, 6, 2, tmp_path / "own.jsonl", "t")
    assert [item.id for item in items] == IDS
    for item, prompt in zip(items, PROMPTS):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert item.prompt_len == len(prompt_ids) and item.input_ids[: item.prompt_len] == prompt_ids
        assert item.input_ids[item.prompt_len :] == greedy_alone(model, tokenizer, prompt, 6)


def test_cached_answers_are_reused_and_a_torn_line_is_regenerated(tmp_path, monkeypatch):
    model, tokenizer = make_tiny_llama().eval(), make_tiny_tokenizer()
    cache = tmp_path / "own.jsonl"
    first = distill.self_distilled(model, tokenizer, IDS, PROMPTS, 6, 2, cache, "t")
    lines = cache.read_text().splitlines()
    cache.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # interrupted mid-write

    asked: list[str] = []
    real = distill.greedy_answer_ids

    def counting(model, tokenizer, prompts, *args, **kwargs):
        asked.extend(prompts)
        return real(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(distill, "greedy_answer_ids", counting)
    again = distill.self_distilled(model, tokenizer, IDS, PROMPTS, 6, 2, cache, "t")
    done = json.loads(lines[0])["id"]
    assert sorted(asked) == sorted(p for i, p in zip(IDS, PROMPTS) if i != done)
    assert [item.input_ids for item in again] == [item.input_ids for item in first]
    assert len(cache.read_text().splitlines()) == 3


@pytest.mark.parametrize(
    "targets, rows, main_loss",
    [("own", 2, [True, True]), ("frozen", 2, [False, False]), ("references", 3, [True, False, False])],
)
def test_distill_rows_by_main_targets(targets, rows, main_loss):
    """Unfinished own answers are dropped; the main stream trains on what main_targets names."""
    answers = [Encoded("a", [5, 9, 2], 1), Encoded("b", [5, 9, 9], 1), Encoded("c", [5, 2], 1)]
    items, finished = distill.distill_rows(answers, [Encoded("ref", [5, 6, 7], 2)], 2, targets, 3)
    assert finished == 2 and len(items) == rows and [item.main_loss for item in items] == main_loss
    assert "b" not in [item.id for item in items]


def test_frozen_with_references_trains_the_streams_on_both():
    answers = [Encoded("a", [5, 9, 2], 1), Encoded("b", [5, 9, 9], 1)]
    items, finished = distill.distill_rows(
        answers, [Encoded("ref", [5, 6, 7], 2)], 2, "frozen", 3, with_references=True
    )
    assert finished == 1 and [item.id for item in items] == ["ref", "a"]
    assert [item.main_loss for item in items] == [False, False]


def test_no_finished_answer_is_a_clear_error():
    with pytest.raises(ValueError, match="none of the first stage's 1 answers ended within 3 tokens"):
        distill.distill_rows([Encoded("b", [5, 9, 9], 1)], [], 2, "frozen", 3)
