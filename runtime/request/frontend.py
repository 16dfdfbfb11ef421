"""The library every front end shares (the generate CLI, the bench and tools, the demo, the Python API and a
server): open a model and turn a request into decode settings; runtime/request/api.py's Model.run drives every
generation, and a request's inputs (prompt ids, input files) are runtime/request/inputs.py's.

    loaded = load_model(Path("artifacts/dialogsum"))
    ids = prompt_ids(loaded, "#Person1#: Hi ...", as_task=True)
    print(Model(loaded).run(ids, DecodeRequest(max_new_tokens=64)).text)

A front end states what it was asked as a DecodeRequest (the CLI from its flags, the demo from its panes, a server
from its JSON); runtime/request/checks.py's `decode_settings` is the one place a request becomes DecodeSettings, and
the one home of every check on the way (re-exported here). Bad values are ValueErrors of one line naming the field
and the fix; nothing here parses flags or prints.
"""

from __future__ import annotations

from pathlib import Path

from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.checks import BASELINE_METHOD as BASELINE_METHOD
from streamfuse.runtime.request.checks import DEFAULT_METHOD as DEFAULT_METHOD
from streamfuse.runtime.request.checks import DEFAULT_TREE as DEFAULT_TREE
from streamfuse.runtime.request.checks import DecodeRequest as DecodeRequest
from streamfuse.runtime.request.checks import check_method as check_method
from streamfuse.runtime.request.checks import check_prompt_format as check_prompt_format
from streamfuse.runtime.request.checks import check_task as check_task
from streamfuse.runtime.request.checks import choose_tree as choose_tree
from streamfuse.runtime.request.checks import decode_settings as decode_settings
from streamfuse.runtime.request.loader import Loaded, artifact_tasks, fastest_backend, load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace

# --- the model ----------------------------------------------------------------------------------


def load_model(
    artifact: Path,
    backend: str | None = None,
    device: str = "cpu",
    stream_schedule: str = "fused",
    threads: int | None = None,
    task: str | None = None,
) -> Loaded:
    """An artifact or checkpoint folder, loaded on `backend` (None: the fastest it has here, by its calibrations);
    on an artifact serving several tasks, `task` picks one (a task it does not serve loads its own)."""
    task = task if task in artifact_tasks(artifact) else None
    backend = backend or fastest_backend(artifact, task)
    return load(artifact, backend, device, stream_schedule, threads, task=task)


# --- runs ---------------------------------------------------------------------------------------


def new_trace(
    loaded: Loaded, settings: DecodeSettings, enabled: bool = True, device: str = "cpu", threads: int | None = None
) -> Trace:
    """A trace of runs with these settings, its header naming the backend, method and tree."""
    tree = settings.tree.to_dict() if registry.get(settings.method).speculative else None
    return Trace(
        enabled=enabled,
        backend=loaded.backend.name,
        device=device,
        method=settings.method,
        num_streams=loaded.backend.num_streams,
        tree=tree,
        threads=threads,
    )
