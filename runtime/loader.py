"""Artifact folder -> backend, tokenizer and what the runtime must know about the model.

Today the PyTorch backend loads fine-tuned checkpoints (export/build.py output); exported
artifacts (manifest.json with .pte / .onnx / .mlpackage files) plug in through the same call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamfuse.runtime.backends.base import STREAM_SCHEDULES, Backend  # noqa: F401  (STREAM_SCHEDULES: for the CLIs)
from streamfuse.runtime.prompt import PromptFormat

BACKENDS = ("torch",)


@dataclass
class Loaded:
    backend: Backend
    tokenizer: object
    info: dict  # the checkpoint's training info (task, preset, ...)
    prompt: PromptFormat | None  # the task's prompt format, when the model was fine-tuned on one

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)


def load(artifact: Path, backend: str = "torch", device: str = "cpu", stream_schedule: str = "fused") -> Loaded:
    artifact = Path(artifact)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available; choose one of {', '.join(BACKENDS)}")
    if not artifact.is_dir():
        raise FileNotFoundError(f"{artifact} is not a folder: pass a checkpoint made by export/build.py "
                                f"(e.g. checkpoints/dialogsum-cpu/ss)")
    if not (artifact / "streamfuse.json").is_file():
        raise FileNotFoundError(f"{artifact} has no streamfuse.json: the torch backend loads checkpoints made by "
                                f"export/build.py (e.g. checkpoints/dialogsum-cpu/ss)")
    from streamfuse.adapters.checkpoint import load_checkpoint
    from streamfuse.runtime.backends.pytorch import TorchBackend

    model, tokenizer, manifest = load_checkpoint(artifact, merge_lora=True)
    prompt = manifest["info"].get("prompt")
    return Loaded(TorchBackend(model, device, stream_schedule), tokenizer, manifest["info"], PromptFormat.from_dict(prompt) if prompt else None)
