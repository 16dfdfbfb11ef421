"""Save and load a fine-tuned Speculative Streaming model as plain files.

    <dir>/streamfuse.json        what the model is: base model (and how many of its layers), StreamConfig,
                                 LoRA settings
    <dir>/lora/                  the peft adapter (safetensors) - shareable across tasks on one base
    <dir>/streams.safetensors    stream-identifier embeddings, f_eta and the pruning head
    <dir>/tokenizer/             the tokenizer the model was trained with
Loading never unpickles: safetensors and JSON only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .base_model import load_base_model
from .config import LoraSettings, StreamConfig
from .hf import keep_first_layers
from .model import SpeculativeStreamingLM

MANIFEST = "streamfuse.json"
FORMAT_VERSION = 2  # 2: base_layers (a draft model keeps the base's first layers only)


def extra_state(model: SpeculativeStreamingLM) -> dict[str, torch.Tensor]:
    """The non-LoRA trainable tensors (streams and pruning head)."""
    state = {f"stream_init.{k}": v for k, v in model.stream_init.state_dict().items()}
    state.update({f"pruning_head.{k}": v for k, v in model.pruning_head.state_dict().items()})
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def save_checkpoint(
    model: SpeculativeStreamingLM,
    tokenizer,
    directory: Path,
    base_model: str,
    lora: LoraSettings,
    info: dict | None = None,
    base_layers: int | None = None,
) -> None:
    """Write atomically: a temp folder beside the target, renamed into place when complete.
    base_layers: the model keeps the base's first this-many decoder layers (None: all)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
    try:
        model.model.save_pretrained(staging / "lora")
        save_file(extra_state(model), str(staging / "streams.safetensors"))
        tokenizer.save_pretrained(staging / "tokenizer")
        manifest = {
            "format_version": FORMAT_VERSION,
            "base_model": base_model,
            "base_layers": base_layers,
            "streams": asdict(model.config),
            "lora": {**asdict(lora), "target_modules": list(lora.target_modules)},
            "info": info or {},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a streamfuse checkpoint (run streamfuse build)")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {manifest.get('format_version')}, this streamfuse reads "
            f"{FORMAT_VERSION}: rebuild the checkpoint with this version"
        )
    return manifest


def weights_digest(directory: Path) -> str:
    """sha256 (16 hex digits) of the checkpoint's trained weights: the LoRA adapter and the streams.
    Retraining with the same settings can give other weights (another torch, another seed), so
    whatever is built from a checkpoint (evaluations, exported graphs) is keyed on this too."""
    directory = Path(directory)
    files = sorted((directory / "lora").glob("*.safetensors")) + [directory / "streams.safetensors"]
    digest = hashlib.sha256()
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {directory} is an incomplete checkpoint; retrain it with streamfuse build"
            )
        digest.update(path.relative_to(directory).as_posix().encode())
        with path.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def update_info(directory: Path, **fields) -> None:
    """Add metadata to a checkpoint's manifest without touching its weights (atomic rewrite)."""
    path = Path(directory) / MANIFEST
    manifest = read_manifest(directory)
    manifest["info"].update(fields)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)


def load_checkpoint(
    directory: Path,
    base_model: str | None = None,
    merge_lora: bool = False,
    trainable: bool = False,
    adapter_name: str = "default",
):
    """Rebuild (SpeculativeStreamingLM, tokenizer, manifest) from a checkpoint folder, in eval mode.

    merge_lora folds the adapter into the base weights: same function, no per-projection LoRA
    matmuls at inference (the runtime's choice); trainable leaves the adapter's weights trainable,
    to train on from this checkpoint. adapter_name: peft's name for the adapter (TaskSet names it by task)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    directory = Path(directory)
    manifest = read_manifest(directory)
    base, _ = load_base_model(base_model or manifest["base_model"])
    if manifest["base_layers"] is not None:
        keep_first_layers(base, manifest["base_layers"])
    if merge_lora and trainable:
        raise ValueError("a merged adapter cannot be trained: pass merge_lora or trainable, not both")
    peft_model = PeftModel.from_pretrained(base, directory / "lora", adapter_name=adapter_name, is_trainable=trainable)
    inner = peft_model.merge_and_unload() if merge_lora else peft_model
    model = SpeculativeStreamingLM(inner, StreamConfig.from_dict(manifest["streams"]))
    load_extra_state(model.stream_init, model.pruning_head, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
    return model.eval(), tokenizer, manifest


def load_extra_state(stream_init: nn.Module, pruning_head: nn.Module, directory: Path) -> None:
    """Fill streams and a pruning head from a checkpoint's streams.safetensors (extra_state's names)."""
    path = Path(directory) / "streams.safetensors"
    state = load_file(str(path))
    parts = {"stream_init": stream_init, "pruning_head": pruning_head}
    missing = {f"{name}.{key}" for name, part in parts.items() for key in part.state_dict()} ^ set(state)
    if missing:
        raise ValueError(f"{path} does not match the config: tensors {sorted(missing)}")
    for name, part in parts.items():
        part.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{name}.")})
