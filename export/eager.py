"""PyTorch backend (CPU and CUDA): the graphs' functions run eagerly (export/passes.py) under
the same host as the exported graphs (runtime/backends/static_graph.py: one KV cache, one acceptance, one
lazy stream and head path), with what eager execution adds: any row count, the cache on the device written
in place, and tree pruning."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse import seams
from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.adapters.task_set import TaskSet
from streamfuse.export.packed_linear import PackedLinear, resolve_kernels
from streamfuse.export.passes import (
    SCRATCH,
    GreedyStepPass,
    HeadsPass,
    MainPass,
    PrefillPass,
    PrunedStepPass,
    StepPass,
    StreamsPass,
)
from streamfuse.runtime.artifact.contract import (
    CACHE_INPUTS,
    INPUT_NAMES,
    NEW_ROWS,
    OUTPUT_NAMES,
    STREAM_SCHEDULES,
    GraphSpec,
    base_method,
)
from streamfuse.runtime.artifact.format import Artifact
from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.backends.static_graph import StaticGraphBackend

# Ranks per stream a greedy step drafts: trees with a wider level run step + streams instead.
DRAFT_WIDTH = 16


class TorchRunner:
    """The graphs' functions in the "scratch" layout, run by torch on `device`: a call's rows go into the
    cache's free slots in place, so the cache (tensors the host allocates on the device) is never copied.
    Other inputs come as numpy; outputs but the new K/V rows go back to the host as numpy."""

    name = "torch"
    prunes = True  # it has pruned_step

    def __init__(self, model: SpeculativeStreamingLM, device: str, dtype: torch.dtype, schedule: str):
        self.model, self.device, self.dtype, self.schedule = model, device, dtype, schedule
        self.modules = {
            "decode": MainPass(model, 1, SCRATCH),
            "streams": StreamsPass(model, SCRATCH),
            "step": StepPass(model, SCRATCH),
            "pruned_step": PrunedStepPass(model, SCRATCH),
        }
        self._greedy: dict[int, GreedyStepPass] = {}
        self._own_buffers(self.modules["decode"])

    def add_heads(self, heads: nn.Module) -> None:
        self.modules["heads"] = HeadsPass(self.model, heads, SCRATCH)

    @torch.inference_mode()
    def run(self, method: str, inputs: list) -> list:
        base = base_method(method)
        tensors = [self._tensor(name, value) for name, value in zip(INPUT_NAMES[base], inputs)]
        outputs = self._module(base, tensors[0].shape[1] if base in ("prefill", "greedy_step") else 0)(*tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return [out if name in NEW_ROWS else host(out) for name, out in zip(OUTPUT_NAMES[base], outputs)]

    def _module(self, method: str, rows: int) -> torch.nn.Module:
        if method == "prefill":  # a chain of the prompt's length
            return self._own_buffers(PrefillPass(self.model, rows, SCRATCH))
        if method == "greedy_step":
            if rows not in self._greedy:
                self._greedy[rows] = self._own_buffers(
                    GreedyStepPass(self.model, rows, DRAFT_WIDTH, None, self.schedule, SCRATCH)
                )
            return self._greedy[rows]
        return self.modules[method]

    def _own_buffers(self, module: torch.nn.Module) -> torch.nn.Module:
        """The pass's own buffers on the device (the model is there already)."""
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None:
                setattr(module, name, buffer.to(self.device))
        return module

    def _tensor(self, name: str, value) -> torch.Tensor:
        if name in CACHE_INPUTS:
            return value  # the host's device tensors
        tensor = torch.from_numpy(np.ascontiguousarray(value)).to(self.device)
        return tensor.to(self.dtype) if name == "anchor" else tensor


class TorchBackend(StaticGraphBackend):
    """stream_schedule: where a greedy step runs its streams. "fused": beside every tree node in the one
    forward pass (the paper's schedule; best where a pass is memory-bound); "deferred": the pass verifies
    only, then the streams of the accepted node alone run through the N_s MSA layers (same outputs, far less
    compute; best on CPUs). Sampling always runs step, then streams (deferred).
    kernels "packed" swaps the linear layers for oneDNN-prepacked ones (packed_linear.py), so a
    tree step's few rows cost little more than one; "auto" packs wherever that is possible. The
    swap happens in place on `model`: pass kernels="eager" for a model that is exported later."""

    def __init__(
        self, model: SpeculativeStreamingLM, device: str = "cpu", stream_schedule: str = "fused", kernels: str = "auto"
    ):
        if stream_schedule not in STREAM_SCHEDULES:
            raise ValueError(f"stream_schedule must be one of {STREAM_SCHEDULES}, got {stream_schedule!r}")
        self.model = model.to(device).eval().requires_grad_(False)  # inference only: no autograd state
        self.dtype = next(model.parameters()).dtype
        self.kernels = resolve_kernels(kernels, device, self.dtype)
        if self.kernels == "packed":
            self.model.replace_linears(PackedLinear)
        parts = model.parts
        spec = GraphSpec(
            parts.num_layers,
            parts.num_kv_heads,
            parts.head_dim,
            parts.vocab_size,
            model.num_streams,
            parts.max_positions,
            prefill_chunk=0,
            buckets=(),
            greedy_schedules=(stream_schedule,),
            width=DRAFT_WIDTH,
            dynamic=True,
            head_ids=model.kept_vocab(),
        )
        super().__init__(
            TorchRunner(self.model, device, self.dtype, stream_schedule),
            spec,
            device,
            zeros=lambda shape: torch.zeros(shape, dtype=self.dtype, device=device),
        )
        self.heads: nn.Module | None = None  # Medusa heads (attach_heads)
        self.tasks: TaskSet | None = None  # several tasks' adapters on the model (a multi-task artifact)

    def use_task(self, task: str) -> None:
        """Run another of the loaded tasks (TaskSet: peft's set_adapter, its streams), then pack what it swapped in
        as the rest was packed (swap_modules passes over layers already packed)."""
        if self.tasks is None:
            raise ValueError("this model was loaded with one task; load a multi-task artifact to switch tasks")
        self.tasks.use(task)
        if self.kernels == "packed":
            self.model.replace_linears(PackedLinear)

    def attach_heads(self, heads: nn.Module) -> None:
        """Medusa heads on the target's last hidden state: every step's output then ranks their drafts
        too (StepOutput.extras[HEAD_LOGITS]), computed only for the node a drafter asks for."""
        self.heads = heads.to(self.device, self.dtype).eval().requires_grad_(False)
        self.runner.add_heads(self.heads)
        self.spec = dataclasses.replace(self.spec, heads=heads.num_heads)

    @classmethod
    def with_random_weights(
        cls,
        base_model: str,
        streams: StreamConfig,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        stream_schedule: str = "fused",
        kernels: str = "auto",
    ) -> TorchBackend:
        """Same architecture as `base_model` (a config is enough), random weights: step latency
        depends on shapes only, so it can be measured where the weights cannot travel."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from streamfuse.adapters.base_model import resolve_base_model

        config = AutoConfig.from_pretrained(resolve_base_model(base_model))
        seams.set_attention_implementation(config, "sdpa")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # The streams' own parameters start in fp32: the whole model runs in `dtype`.
        return cls(SpeculativeStreamingLM(model, streams).to(dtype), device, stream_schedule, kernels)

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        if self.device.startswith("cuda"):
            return int(torch.cuda.max_memory_allocated())
        return process_peak_rss_bytes()


def open_checkpoint(
    folder: Path, device: str = "cpu", stream_schedule: str = "fused", artifact: Artifact | None = None
) -> tuple[TorchBackend, object, dict]:
    """The torch backend over a fine-tuned checkpoint folder -> (backend, tokenizer, the checkpoint's manifest): the
    `torch` entry point of group streamfuse.backends, which runtime/request/loader.py opens. artifact: the exported
    artifact the checkpoint is the adapter of (its pruned head, its other tasks), None for a bare checkpoint."""
    from streamfuse.adapters.checkpoint import load_checkpoint

    several = artifact is not None and len(artifact.tasks) > 1
    # One task: the LoRA merged (fastest). Several: each task's adapter beside the others on the unmerged base.
    model, tokenizer, manifest = load_checkpoint(
        folder, merge_lora=not several, adapter_name=artifact.task if several else "default"
    )
    kept = artifact.head_ids() if artifact is not None else None
    if kept is not None:  # a draft model exported with a pruned head runs with the same head on torch
        model.keep_vocab(torch.from_numpy(kept))
    tasks = _task_set(model, manifest, artifact) if several else None
    backend = TorchBackend(model, device, stream_schedule)
    backend.tasks = tasks
    return backend, tokenizer, manifest


def _task_set(model: SpeculativeStreamingLM, manifest: dict, artifact: Artifact) -> TaskSet:
    """Every task of the artifact on `model` (loaded with the artifact's task), that task active."""
    tasks = TaskSet(model, manifest, artifact.task)
    for task in artifact.tasks:
        if task != artifact.task:
            tasks.add(task, artifact.for_task(task).adapter_path())
    return tasks


def host(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as a host numpy array: float32 for floats (a view on CPU when it is float32 already), int64
    ids as they are."""
    tensor = tensor.detach()
    return (tensor.float() if tensor.is_floating_point() else tensor).cpu().numpy()
