"""Medusa on a torch target: the artifact's heads (methods/medusa/model.py) attached to the target's backend,
which runs them beside its verify pass. Runtime files reach it through registry.part(name, "torch_pass")."""

from __future__ import annotations

from pathlib import Path

from streamfuse.methods.medusa.model import load_heads


def attach_heads(backend, folder: Path) -> int:
    """The heads in `folder` on `backend` (once: a backend keeps them) -> how many there are."""
    if backend.heads is None:
        backend.attach_heads(load_heads(folder))
    return backend.heads.num_heads
