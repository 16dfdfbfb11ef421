"""streamfuse: Speculative Streaming for on-device LLM inference (fine-tune, export, run).

    import streamfuse
    model = streamfuse.load("artifacts/dialogsum")   # runtime/request/api.py: generate, stream, chat, conversations

Importing the package sets OMP_WAIT_POLICY=PASSIVE unless it is set: it takes effect only if it comes
before torch's OpenMP runtime loads, which every `python -m streamfuse...` entry point guarantees (the
package is imported before the module), and spin-waiting threads would otherwise steal the cores of
whatever runs next on a small CPU, distorting every timing the tools print. The import loads nothing else
(no numpy, no engine): `load` imports the runtime when it is called.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def load(artifact, backend: str = "auto", task: str | None = None, threads: int | None = None):
    """Open an artifact (or a fine-tuned checkpoint) for generation -> runtime.request.api.Model (see its load)."""
    from streamfuse.runtime.request.api import load as load_model

    return load_model(artifact, backend, task, threads)
