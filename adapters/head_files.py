"""Small trained heads on disk (Medusa's heads, SpecDec++'s acceptance head): their weights as
safetensors and a JSON manifest written last, so a folder with a manifest is complete.

    <dir>/<manifest>.json      format version, shape, info
    <dir>/heads.safetensors    the weights
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from streamfuse.head_format import WEIGHTS


def residual_blocks(hidden_size: int, count: int) -> nn.ModuleList:
    """`count` blocks h + SiLU(W h + b) as their Linear layers, W and b zero: each starts as the identity."""
    blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(count))
    for block in blocks:
        nn.init.zeros_(block.weight)
        nn.init.zeros_(block.bias)
    return blocks


def save_head(module: nn.Module, directory: Path, manifest_name: str, manifest: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / manifest_name).unlink(missing_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(state, str(directory / WEIGHTS))
    (directory / manifest_name).write_text(json.dumps(manifest, indent=2))


def load_head_weights(module: nn.Module, directory: Path) -> nn.Module:
    module.load_state_dict(load_file(str(Path(directory) / WEIGHTS)))
    return module.eval()
