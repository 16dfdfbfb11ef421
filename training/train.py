"""Fine-tune LoRA + streams with the eq. 5 objective; resumable, accelerate-ready.

Single process on a CPU, or `accelerate launch -m streamfuse.training.build ...` on several GPUs: each
process takes every n-th micro-batch and accelerate averages gradients.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from streamfuse.adapters.masks import causal_mask
from streamfuse.adapters.model import BottomState, SpeculativeStreamingLM
from streamfuse.training.config import TrainConfig
from streamfuse.training.data import Batch, Encoded, epoch_batches
from streamfuse.training.frozen_states import FrozenStates
from streamfuse.training.loss import streaming_loss


@dataclass
class TrainResult:
    seconds: float
    optimizer_steps: int
    tokens: int
    final_losses: dict[str, float]


def forward_batch(model: SpeculativeStreamingLM, batch: Batch, with_streams: bool, bottom: BottomState | None = None):
    """Training forward: causal mask over right-padded rows, streams at the answer anchors;
    from the frozen layers' stored output when `bottom` is given."""
    positions = torch.arange(batch.input_ids.shape[1])[None].expand_as(batch.input_ids)
    return model(
        batch.input_ids,
        positions,
        causal_mask(batch.padding),
        anchors=batch.anchors if with_streams else None,
        with_pruning=with_streams,
        bottom=bottom,
    )


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _parameter_groups(model: SpeculativeStreamingLM, config: TrainConfig) -> list[dict]:
    """LoRA at the base rate; stream embeddings and the (detached) pruning head at
    stream_lr_scale times it: both are small, freshly initialised heads that would barely move
    otherwise. f_eta's maps act on the full residual stream, so they need no such boost, only
    init_lr_scale when they start from scratch beside LoRA."""
    init = model.stream_init
    identifiers = [init.identifiers] if init.identifiers is not None else []
    scales = {id(p): config.stream_lr_scale for p in [*identifiers, *model.pruning_head.parameters()]}
    if init.down is not None:
        scales.update({id(init.down.weight): config.init_lr_scale, id(init.up): config.init_lr_scale})
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for p in _trainable(model).values():
        groups.setdefault(scales.get(id(p), 1.0), []).append(p)
    return [{"params": params, "lr": config.learning_rate * scale} for scale, params in sorted(groups.items())]


class Snapshot:
    """Resumable training state in one folder, replaced atomically on every save."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def save(self, model, optimizer, scheduler, progress: dict) -> None:
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="snapshot.tmp-", dir=self.directory.parent))
        tensors = {name: p.detach().contiguous().cpu() for name, p in _trainable(model).items()}
        save_file(tensors, str(staging / "trainable.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, staging / "optimizer.pt")
        (staging / "progress.json").write_text(json.dumps(progress))
        old = self.directory.with_name(self.directory.name + ".old")
        if self.directory.exists():
            self.directory.rename(old)
        staging.rename(self.directory)
        shutil.rmtree(old, ignore_errors=True)

    def load(self, model, optimizer, scheduler) -> dict | None:
        if not (self.directory / "progress.json").is_file():
            return None
        tensors = load_file(str(self.directory / "trainable.safetensors"))
        params = _trainable(model)
        if set(tensors) != set(params):
            raise ValueError(f"{self.directory} was written for another model; delete it to start over")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)
        # weights_only: optimizer state is tensors and numbers; nothing to unpickle.
        state = torch.load(self.directory / "optimizer.pt", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        return json.loads((self.directory / "progress.json").read_text())


def train(
    model: SpeculativeStreamingLM,
    items: list[Encoded],
    config: TrainConfig,
    snapshot_dir: Path,
    pad_id: int,
    with_streams: bool,
    label: str,
    states: FrozenStates | None = None,
) -> TrainResult:
    """Train in place. with_streams=False is the next-token-only LoRA baseline. `states` keeps
    the frozen bottom layers' output per example across epochs (and across calls that share it)."""
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    config.validate()
    accelerator = Accelerator(
        gradient_accumulation_steps=config.grad_accumulation, mixed_precision=config.mixed_precision
    )
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        _parameter_groups(model, config), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    micro_per_epoch = math.ceil(len(items) / config.micro_batch)
    total_micro = math.ceil(config.epochs * micro_per_epoch)
    # accelerate steps a prepared scheduler once per process at each sync, so count all micro-batches.
    total_steps = math.ceil(total_micro / config.grad_accumulation)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * total_steps), total_steps)
    snapshot = Snapshot(snapshot_dir)
    progress = snapshot.load(model, optimizer, scheduler) or {"micro": 0, "steps": 0, "tokens": 0, "seconds": 0.0}
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model.train()
    weights = dict(
        main_weight=config.main_weight,
        stream_weight=config.stream_weight if with_streams else 0.0,
        pruning_weight=config.pruning_weight,
    )
    bar = tqdm(total=total_micro, initial=progress["micro"], desc=f"train {label}", unit="ex", dynamic_ncols=True)
    running: dict[str, float] = {}
    started = time.perf_counter() - progress["seconds"]
    batches = None
    for index in range(progress["micro"], total_micro):
        epoch, within = divmod(index, micro_per_epoch)
        if batches is None or within == 0:
            batches = epoch_batches(items, config.micro_batch, pad_id, config.seed, epoch)
            for _ in range(within):  # resume mid-epoch: skip what was already trained
                next(batches)
        batch = next(batches)
        if index % accelerator.num_processes != accelerator.process_index:
            continue
        with accelerator.accumulate(model):
            bottom = None
            if states is not None:
                with accelerator.autocast():
                    bottom = states.bottom(accelerator.unwrap_model(model), batch)
            output = forward_batch(model, batch, with_streams, bottom)
            terms = streaming_loss(accelerator.unwrap_model(model), output, batch, **weights)
            accelerator.backward(terms["total"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        values = {k: v.item() for k, v in terms.items()}
        running = {k: 0.9 * running.get(k, v) + 0.1 * v for k, v in values.items()}
        progress.update(micro=index + 1, tokens=progress["tokens"] + batch.num_tokens)
        bar.set_postfix({k: f"{v:.3f}" for k, v in running.items() if k in ("total", "main", "stream_1")})
        bar.update(1)
        if accelerator.sync_gradients:
            progress["steps"] += 1
            if progress["steps"] % config.save_every == 0 and accelerator.is_main_process:
                progress["seconds"] = time.perf_counter() - started
                snapshot.save(accelerator.unwrap_model(model), optimizer, scheduler, progress)
    bar.close()
    model.eval()
    seconds = time.perf_counter() - started
    return TrainResult(seconds, progress["steps"], progress["tokens"], {k: round(v, 4) for k, v in running.items()})
