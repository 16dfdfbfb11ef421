"""ExecuTorch: one multi-method .pte (prefill, decode, step, streams) per delegate.

- xnnpack: CPUs (phones, laptops, desktops); runs here, parity-checked.
- coreml: Apple's Neural Engine / GPU through ExecuTorch's Core ML delegate (runs in an iOS or
  macOS app; the Linux runtime has no Core ML backend, so it is built here, run on device).
Vulkan (Android GPUs) does not lower here: its serializer's flatc step rejects the graph's JSON
("cannot parse value starting with: -", executorch 1.4.1), so it is not offered.
Methods share their weights: the delegates store constants in the program's named data by
content, so four methods cost one copy of the model. Optional weight quantization (torchao)
runs before export: int8 (dynamic int8 activations, int8 weights per channel) or 8da4w (int8
dynamic activations, int4 weights in groups of 32), both lowered to XNNPACK's quantized kernels;
q4-native puts the base GGUF's own codes in the same kernels (export/xnnpack_low_bit.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamfuse import seams

QUANTIZATIONS = ("none", "int8", "8da4w")
GROUP = 32  # 8da4w: int4 weights share a scale per 32 input channels


def quantize_weights(model: nn.Module, scheme: str) -> None:
    """In place: replace the linear layers' weights by torchao's quantized tensors."""
    if scheme == "none":
        return
    from torchao.quantization import quantize_

    # Group-wise int4 needs in_features divisible by the group; the rank-8 pruning head is not
    # (and is not in the exported graphs anyway), so only such linears are quantized.
    quantize_(
        model,
        torchao_config(scheme),
        filter_fn=lambda module, _: isinstance(module, nn.Linear) and module.in_features % GROUP == 0,
    )


def torchao_config(scheme: str):
    """torchao's weight config for "int8" (per output channel) or "8da4w" (int4 per group of 32),
    both with int8 activations per token. The Intx config leaves quantize/dequantize patterns that
    XNNPACK fuses into its kernels (Int8DynamicActivationInt8WeightConfig lowers to aten._int_mm,
    which XNNPACK does not take)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if scheme == "int8":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP))
    raise ValueError(f"quantization {scheme!r} is not one of {QUANTIZATIONS}")


DELEGATES = ("xnnpack", "coreml")


def partitioner(delegate: str, dynamic_linears: bool = False):
    """dynamic_linears: fp32 linear layers whose weights are graph inputs (a task's LoRA, export/task_inputs.py) run
    on XNNPACK too, their weights packed on every call; every layer whose weight is a constant keeps it packed once."""
    if delegate == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return XnnpackPartitioner(configs=seams.xnnpack_configs_with_input_weights() if dynamic_linears else None)
    if delegate == "coreml":
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner

        specs = CoreMLBackend.generate_compile_specs(
            minimum_deployment_target=ct.target.iOS17, compute_precision=ct.precision.FLOAT16
        )
        return CoreMLPartitioner(compile_specs=specs)
    raise ValueError(f"ExecuTorch delegate {delegate!r} is not one of {DELEGATES}")


def export_pte(
    modules: dict[str, nn.Module],
    inputs: dict[str, tuple],
    path: Path,
    delegate: str = "xnnpack",
    dynamic_linears: bool = False,
) -> None:
    """Lower all methods into one .pte at `path` (the caller writes into a staging folder).
    Programs are exported afresh per call: the Core ML partitioner mutates what it is given."""
    from executorch.exir import to_edge_transform_and_lower

    programs = {name: torch.export.export(module, inputs[name], strict=False) for name, module in modules.items()}
    if delegate == "xnnpack":
        from streamfuse.export.xnnpack_graph import views_for_xnnpack

        programs = {name: views_for_xnnpack(program) for name, program in programs.items()}
    config = seams.edge_config_without_ir_check()  # the build checks each program against eager itself
    with seams.lowering_shares_weights(), seams.shallow_provenance(), seams.xnnpack_passes_that_can_act():
        lowered = to_edge_transform_and_lower(
            programs, partitioner=[partitioner(delegate, dynamic_linears)], compile_config=config
        )
        Path(path).write_bytes(lowered.to_executorch(host_inputs()).buffer)


def host_inputs():
    """Inputs stay in the caller's buffers: a memory-planned input is copied into the program's
    arena on every call, and the KV cache inputs are 35 MB (SmolLM2 at 768 rows), a few ms a call."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    return ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
