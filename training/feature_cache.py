"""Training features kept on disk (safetensors) so a rerun or a resumed build does not compute them again."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def load_features(path: Path) -> dict[str, torch.Tensor] | None:
    return load_file(str(path)) if path.is_file() else None


def save_features(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Written beside the target and renamed into place: a reader never meets half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
