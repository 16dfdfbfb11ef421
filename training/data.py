"""Turn task examples into chat-formatted token ids, labels and stream anchors."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from streamfuse.runtime.artifact.prompt import PromptFormat
from streamfuse.training.tasks.base import Example, Task

IGNORE = -100  # label of tokens that carry no loss (the prompt)


@dataclass(frozen=True)
class Encoded:
    id: str
    input_ids: list[int]  # prompt + target + eos
    prompt_len: int
    main_loss: bool = True  # False: the answer trains the streams only (the model's own answers)


def prompt_format(task: Task, max_source_tokens: int) -> PromptFormat:
    """The task's prompt as data: recorded in checkpoints so the runtime formats inputs the same way."""
    return PromptFormat(task.instruction_template, task.source_template, max_source_tokens)


def prompt_text(task: Task, tokenizer, example: Example, max_source_tokens: int) -> str:
    """The chat-formatted prompt, ending where the assistant's answer starts."""
    return prompt_format(task, max_source_tokens).render(tokenizer, example.source)


def encode(task: Task, tokenizer, example: Example, max_source_tokens: int, max_target_tokens: int) -> Encoded:
    """Prompt ids followed by the first reference and the end-of-turn token."""
    prompt = tokenizer(prompt_text(task, tokenizer, example, max_source_tokens), add_special_tokens=False)["input_ids"]
    target = tokenizer(example.references[0], add_special_tokens=False)["input_ids"][:max_target_tokens]
    return Encoded(example.id, prompt + target + [tokenizer.eos_token_id], len(prompt))


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] right-padded
    padding: torch.Tensor  # [B, L] 1 = real token
    labels: torch.Tensor  # [B, L] token ids to predict at each position's *next* slot; IGNORE on prompt/pad
    anchors: torch.Tensor  # [B, A] main-token indices that get streams (answer-predicting positions)
    anchor_valid: torch.Tensor  # [B, A] False on padding anchors
    main_loss: torch.Tensor  # [B] False on rows whose answer trains the streams only

    @property
    def num_tokens(self) -> int:
        return int(self.padding.sum())


def collate(items: Sequence[Encoded], pad_id: int) -> Batch:
    """Anchors are the positions whose next token is part of the answer: from the last prompt
    token (where decoding inserts streams after prefill) to the second-to-last token."""
    length = max(len(item.input_ids) for item in items)
    spans = [range(item.prompt_len - 1, len(item.input_ids) - 1) for item in items]
    width = max(len(span) for span in spans)
    input_ids = torch.full((len(items), length), pad_id, dtype=torch.long)
    labels = torch.full((len(items), length), IGNORE, dtype=torch.long)
    padding = torch.zeros((len(items), length), dtype=torch.long)
    anchors = torch.zeros((len(items), width), dtype=torch.long)
    anchor_valid = torch.zeros((len(items), width), dtype=torch.bool)
    for row, (item, span) in enumerate(zip(items, spans)):
        ids = torch.tensor(item.input_ids)
        input_ids[row, : len(ids)] = ids
        padding[row, : len(ids)] = 1
        labels[row, item.prompt_len : len(ids)] = ids[item.prompt_len :]
        anchors[row, : len(span)] = torch.tensor(list(span))
        anchor_valid[row, : len(span)] = True
    main_loss = torch.tensor([item.main_loss for item in items])
    return Batch(input_ids, padding, labels, anchors, anchor_valid, main_loss)


def shuffled_rows(count: int, size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of `size` row indices out of `count`: each pass a fresh shuffle (seeded), a batch may
    span two passes. The small heads' training streams (Medusa, SpecDec++'s acceptance head, ParallelSpec)."""
    order, generator = [], random.Random(seed)
    while True:
        if len(order) < size:
            shuffled = list(range(count))
            generator.shuffle(shuffled)
            order += shuffled
        batch, order = order[:size], order[size:]
        yield batch


def epoch_batches(items: Sequence[Encoded], micro_batch: int, pad_id: int, seed: int, epoch: int) -> Iterator[Batch]:
    """A deterministic shuffle per (seed, epoch), so a resumed run sees the same order."""
    order = list(range(len(items)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    for start in range(0, len(order), micro_batch):
        yield collate([items[i] for i in order[start : start + micro_batch]], pad_id)
