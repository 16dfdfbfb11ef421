"""The on-disk format of the small trained heads (Medusa's heads, SpecDec++'s acceptance heads): what
adapters/ writes and loads in torch for training, and runtime/ reads in numpy to decode. Both sides
import it; it imports no streamfuse module (tests/test_layering.py).

    <dir>/<manifest>.json      format version, shape, info; written last, so a folder with one is complete
    <dir>/heads.safetensors    the weights
"""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS = "heads.safetensors"
ACCEPTANCE_MANIFEST = "acceptance.json"
ACCEPTANCE_VERSION = 1


def read_head_manifest(directory: Path, manifest_name: str, version: int, what: str, option: str) -> dict:
    """The manifest, checked: a missing folder or another format is a one-line error naming the fix
    (option: the build's config section that trains these heads)."""
    path = Path(directory) / manifest_name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {directory} holds no {what} (streamfuse build --set {option}.enabled=true makes them)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != version:
        raise ValueError(
            f"{path} has format_version {manifest.get('format_version')}, this streamfuse reads "
            f"{version}: rebuild the {what}"
        )
    return manifest
