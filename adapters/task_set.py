"""Several tasks' fine-tuning over one copy of the base in torch, switched in place.

Each task's LoRA is a peft adapter of the one unmerged model (peft's set_adapter switches them), and its streams
and pruning head are its own small modules swapped in. Nothing is merged or unmerged, so the base's weights stay as
loaded and a task's outputs after any number of switches are those of a fresh load of that task.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_extra_state, read_manifest
from .model import SpeculativeStreamingLM
from .pruning import PruningHead
from .streams import StreamInit

SHARED = ("base_model", "base_layers", "streams")  # what tasks on one base must agree on


class TaskSet:
    """model: an unmerged checkpoint loaded with adapter_name=task (load_checkpoint); manifest: its streamfuse.json."""

    def __init__(self, model: SpeculativeStreamingLM, manifest: dict, task: str):
        self.model, self.manifest, self.active = model, manifest, task
        self.parts = {task: (model.stream_init, model.pruning_head)}

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.parts)

    def add(self, task: str, directory: Path) -> None:
        """Load another task's checkpoint beside the active one: its LoRA as peft adapter `task`, its streams."""
        manifest = read_manifest(directory)
        for key in SHARED:
            if manifest[key] != self.manifest[key]:
                raise ValueError(
                    f"{directory}: task {task}'s {key} differs from task {self.active}'s, so the two "
                    f"cannot share one base model; build them as separate artifacts"
                )
        model = self.model
        model.model.load_adapter(Path(directory) / "lora", adapter_name=task)
        parts = (
            StreamInit(model.config, model.parts.hidden_size),
            PruningHead(model.parts.hidden_size, model.config.pruning_rank),
        )
        load_extra_state(*parts, directory)
        self.parts[task] = parts
        self.use(self.active)  # the loaded adapter's weights stay inactive and frozen

    def use(self, task: str) -> None:
        """Make `task` the one the model runs (its adapter active, its streams and pruning head in place)."""
        if task not in self.parts:
            raise ValueError(f"task {task!r} is not loaded (loaded: {', '.join(self.parts)})")
        model = self.model
        model.model.set_adapter(task)
        device = model.parts.lm_head.weight.device
        model.stream_init, model.pruning_head = (part.to(device) for part in self.parts[task])
        model.eval().requires_grad_(False)  # set_adapter marks the active adapter trainable
        self.active = task
