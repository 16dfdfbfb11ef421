"""Self-distillation: the fine-tuned model's own greedy answers as training data for its streams.

A draft is accepted when it matches what the main stream decodes, not the reference. Trained on
references, stream j at position t must guess x_{t+1+j} after a prefix the model would often not
have written, and many of those targets are ones greedy decoding never produces. On the model's
own greedy answers every stream target is exactly the token decoding will need (Medusa-2's
self-distillation), and the main stream's loss on them holds it to its own outputs.

Answers are generated once per (model, prompt settings) and cached as JSON lines, appended a
block at a time, so an interrupted run keeps what it generated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from streamfuse.training.data import Encoded
from streamfuse.training.evaluation import greedy_answer_ids

BLOCK = 32  # examples generated between appends to the cache


def _read_cache(path: Path) -> dict[str, list[int]]:
    """Answers already generated; a line cut short by an interruption is dropped."""
    answers: dict[str, list[int]] = {}
    if not path.is_file():
        return answers
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        answers[row["id"]] = row["answer"]
    return answers


def _append(path: Path, rows: list[dict]) -> None:
    with path.open("a") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())


def self_distilled(
    model,
    tokenizer,
    ids: Sequence[str],
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
    cache: Path,
    label: str,
) -> list[Encoded]:
    """Prompt + the model's greedy answer (eos included when produced) for every prompt."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    answers = _read_cache(cache)
    if len(answers) < len(ids):  # rewrite without a torn last line before appending
        cache.write_text("".join(json.dumps({"id": i, "answer": answers[i]}) + "\n" for i in answers))
    todo = [index for index, example_id in enumerate(ids) if example_id not in answers]
    bar = tqdm(total=len(ids), initial=len(ids) - len(todo), desc=f"self-distil {label}", unit="ex", dynamic_ncols=True)
    for start in range(0, len(todo), BLOCK):
        block = todo[start : start + BLOCK]
        generated = greedy_answer_ids(
            model, tokenizer, [prompts[i] for i in block], max_new_tokens, batch_size, desc="generate"
        )
        rows = [{"id": ids[i], "answer": answer} for i, answer in zip(block, generated)]
        _append(cache, rows)
        answers.update((row["id"], row["answer"]) for row in rows)
        bar.update(len(block))
    bar.close()
    items = []
    for example_id, prompt in zip(ids, prompts):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        items.append(Encoded(example_id, prompt_ids + answers[example_id], len(prompt_ids)))
    return items


def distill_rows(
    answers: list[Encoded],
    references: list[Encoded],
    eos_id: int,
    main_targets: str,
    answer_limit: int,
    with_references: bool = False,
) -> tuple[list[Encoded], int]:
    """The stage's training rows (see DistillConfig.main_targets) and how many are own answers."""
    # An answer cut at the length limit is usually a loop; training on it teaches looping.
    finished = [item for item in answers if item.input_ids[-1] == eos_id]
    if not finished:
        raise ValueError(
            f"none of the first stage's {len(answers)} answers ended within {answer_limit} tokens, so "
            f"there is nothing to distil: train the first stage longer, or pass --no-distill"
        )
    if main_targets == "own":
        return finished, len(finished)
    if main_targets == "references":  # the main stream learns from the references only
        return references + _streams_only(finished), len(finished)
    # frozen: nothing on the main path trains, so every row (references too, if asked for) trains the streams only
    return _streams_only((references if with_references else []) + finished), len(finished)


def _streams_only(items: list[Encoded]) -> list[Encoded]:
    return [replace(item, main_loss=False) for item in items]
