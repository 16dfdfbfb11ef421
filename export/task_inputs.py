"""A task's tensors as graph inputs: one base graph for every task fine-tuned on the same base.

In the q4-native format the base's weights are the GGUF's own codes, the same for every task, and each
task's trained tensors sit beside them in float: the LoRA (with the base's min terms, Q4Linear's `left` /
`right` of each adapted layer), the stream identifiers and f_eta blocks, the pruning head. TaskInputs makes
those tensors trailing inputs of every method (torch.func.functional_call swaps them in), so the exported
graph holds only the base, and a task is a file of named tensors the host binds per call:

    method(*inputs, *task_tensors)   task tensors in TASK_INPUTS order: sorted by name

Switching tasks is binding another file's tensors; nothing is re-lowered or re-loaded. A single-task
artifact is the same graph with one task file, so a task's outputs are the same bits in both.
"""

from __future__ import annotations

import torch
from torch import nn

from streamfuse.runtime.artifact.contract import TASK_PREFIX  # graph input names: task.<name in the model>

TRAINED_MODULES = ("stream_init", "pruning_head")  # adapters/checkpoint.py extra_state: the non-LoRA trained parts


def task_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor of every trained tensor of a q4-native export model (adapters/model.py
    SpeculativeStreamingLM after use_base_codes / use_xnnpack_codes), sorted by name: the adapted layers'
    `left` and `right` (buffers on ONNX, linear weights on XNNPACK), the streams' and the pruning head's."""
    found = {}
    for path, module in model.named_modules():
        adapted = getattr(module, "adapted", False)
        trained = path in TRAINED_MODULES
        if not (adapted or trained):
            continue
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if trained or name.split(".")[0] in ("left", "right"):
                found[f"{path}.{name}"] = tensor
    if not any(getattr(m, "adapted", False) for m in model.modules()):
        raise ValueError(
            "the model has no adapted low-bit layer: task inputs need the q4-native format's unmerged "
            "LoRA (export/low_bit.py use_base_codes)"
        )
    return dict(sorted(found.items()))


def input_names(model: nn.Module) -> list[str]:
    return [TASK_PREFIX + name for name in task_tensors(model)]


class TaskInputs(nn.Module):
    """`method` (a graph pass over `model`) with the model's task tensors as its trailing inputs."""

    def __init__(self, method: nn.Module, model: nn.Module):
        super().__init__()
        self.method = method
        where = {
            id(t): n
            for n, t in [
                *method.named_parameters(remove_duplicate=False),
                *method.named_buffers(remove_duplicate=False),
            ]
        }
        self.names = [where[id(tensor)] for tensor in task_tensors(model).values()]  # as the method calls them

    def forward(self, *args):
        count = len(args) - len(self.names)
        swapped = dict(zip(self.names, args[count:], strict=True))
        return torch.func.functional_call(self.method, swapped, args[:count], strict=False, tie_weights=False)


def with_task_inputs(
    modules: dict[str, nn.Module], inputs: dict[str, tuple], model: nn.Module
) -> tuple[dict[str, nn.Module], dict[str, tuple]]:
    """Every method wrapped, its example inputs followed by the model's task tensors (copies: distinct inputs). The
    adapted layers switch to the form of their low-rank term that stays exact with input weights (low_bit.low_rank)."""
    for module in model.modules():
        if getattr(module, "adapted", False) and hasattr(module, "task_input"):
            module.task_input = True
    tensors = [t.detach().clone() for t in task_tensors(model).values()]
    return (
        {name: TaskInputs(module, model) for name, module in modules.items()},
        {name: (*inputs[name], *tensors) for name in modules},
    )


def save_task_tensors(model: nn.Module, path) -> None:
    """The task's tensors by graph input name (safetensors): what the host binds to run this task."""
    from safetensors.torch import save_file

    save_file({TASK_PREFIX + n: t.detach().contiguous() for n, t in task_tensors(model).items()}, str(path))
