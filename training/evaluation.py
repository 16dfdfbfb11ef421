"""Quality of the fine-tuned models: task metric from greedy generation, stream accuracy.

Greedy Speculative Streaming output equals the main stream's plain greedy output (the runtime
proves it token for token), so the SS model's task metric is measured on its main stream with
batched plain decoding, which is several times faster on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from streamfuse.adapters.model import SpeculativeStreamingLM, swap_linears
from streamfuse.export.packed_linear import PackedLinear, packing_available
from streamfuse.training.data import Encoded, collate
from streamfuse.training.loss import stream_targets
from streamfuse.training.tasks.base import Example, Task
from streamfuse.training.train import forward_batch


def packed_for_inference(model: nn.Module) -> nn.Module:
    """The same model on oneDNN-packed linear layers, in place, where a CPU can pack: a batch-8
    decode step of `generate` pays eager sgemm's per-call weight repacking otherwise. Inference
    only (the packed kernel has no gradient), so never pass a model that trains afterwards."""
    parameter = next(model.parameters())
    if not packing_available(parameter.device.type, parameter.dtype):
        return model
    if isinstance(model, SpeculativeStreamingLM):
        model.replace_linears(PackedLinear)  # also re-points the LM head its logits() use
    else:
        swap_linears(model, PackedLinear)
    return model


@torch.inference_mode()
def greedy_answer_ids(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int, desc: str
) -> list[list[int]]:
    """Batched greedy decoding with left padding; prompts sorted by length to waste less work.
    Each answer's token ids end with eos when the model produced it, and carry no padding."""
    tokenizer.padding_side = "left"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", dynamic_ncols=True):
        chunk = order[start : start + batch_size]
        encoded = tokenizer([prompts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for i, row in zip(chunk, output[:, encoded["input_ids"].shape[1] :].tolist()):
            answers[i] = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
    return answers


def task_quality(
    model,
    tokenizer,
    task: Task,
    examples: Sequence[Example],
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
    label: str,
) -> dict:
    answers = greedy_answer_ids(model, tokenizer, prompts, max_new_tokens, batch_size, f"generate {label}")
    return answer_quality(tokenizer, task, examples, answers)


def answer_quality(tokenizer, task: Task, examples: Sequence[Example], answers: Sequence[Sequence[int]]) -> dict:
    """The task metric of generated answers (token ids, as greedy_answer_ids returns them)."""
    predictions = [text.strip() for text in tokenizer.batch_decode(answers, skip_special_tokens=True)]
    scores = task.score(predictions, [ex.references for ex in examples])
    samples = [{"id": ex.id, "prediction": p} for ex, p in zip(examples[:5], predictions[:5])]
    return {"scores": scores, "count": len(examples), "samples": samples}


@torch.inference_mode()
def stream_accuracy(model: SpeculativeStreamingLM, items: Sequence[Encoded], pad_id: int, top_k: int) -> dict:
    """Teacher-forced accuracy on answer tokens: stream j at anchor p vs x_{p+1+j}; also the main
    stream and the pruning head vs x_{p+1}, for reference."""
    hits: dict[str, list[int]] = {}

    def count(name: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
        keep = targets >= 0
        if not bool(keep.any()):
            return
        top = logits[keep].topk(top_k, dim=-1).indices
        wanted = targets[keep][:, None]
        top1, topk, total = hits.setdefault(name, [0, 0, 0])
        hits[name] = [
            top1 + int((top[:, :1] == wanted).sum()),
            topk + int((top == wanted).any(-1).sum()),
            total + int(keep.sum()),
        ]

    for item in tqdm(items, desc="stream accuracy", unit="ex", dynamic_ncols=True):
        batch = collate([item], pad_id)
        output = forward_batch(model, batch, with_streams=True)
        anchor_targets = stream_targets(batch.labels, batch.anchors, batch.anchor_valid, 0)
        anchor_hidden = torch.gather(output.hidden, 1, batch.anchors[..., None].expand(-1, -1, output.hidden.shape[-1]))
        count("main", model.logits(anchor_hidden), anchor_targets)
        pruning_hidden = torch.gather(
            output.pruning_hidden, 1, batch.anchors[..., None].expand(-1, -1, output.hidden.shape[-1])
        )
        count("pruning_head", model.logits(pruning_hidden), anchor_targets)
        for j in range(1, model.num_streams + 1):
            targets = stream_targets(batch.labels, batch.anchors, batch.anchor_valid, j)
            count(f"stream_{j}", model.logits(output.stream_hidden[:, :, j - 1]), targets)
    return {
        name: {"top1": 100.0 * t1 / n, f"top{top_k}": 100.0 * tk / n, "tokens": n} for name, (t1, tk, n) in hits.items()
    }
