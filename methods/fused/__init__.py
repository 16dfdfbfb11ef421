"""The fused-drafter base Falcon and ParallelSpec share: a one-layer drafter model on the target's states.

Its runtime side: the host loop (drafter.py), the pass on an engine's graph (graph_pass.py) or in torch
(torch_pass.py), and `draft_pass`, which picks the engine's. Its build side: the model (model.py), its training
(train.py) and its graph export (graph.py). Not a method itself: no METHOD, no registry line.
"""

from __future__ import annotations

from streamfuse.runtime.methods import registry


def draft_pass(loaded, name: str, graph_pass: type):
    """Method `name`'s drafter pass for the loaded target, made once per Loaded: on torch, the method's
    torch_pass.open_pass(backend, drafter folder); else graph_pass.open(...), the artifact's graph of the drafter
    for the target's engine, as the method's manifest entry records it."""
    entry, folder = loaded.artifact.drafters[name], loaded.artifact.drafter_path(name)
    if loaded.engine == "torch":
        return loaded.cached(
            f"{name}:torch", lambda: registry.part(name, "torch_pass").open_pass(loaded.backend, folder)
        )
    if loaded.engine not in entry.get("graphs", {}):
        raise ValueError(
            f"method {name}: {loaded.artifact.path} has no {loaded.engine} graph of its drafter (it "
            f"has {', '.join(entry.get('graphs', {})) or 'none'}); rebuild it with streamfuse build "
            f"{registry.get(name).build_flags}, or pass --backend torch"
        )
    return loaded.cached(
        f"{name}:{loaded.engine}",
        lambda: graph_pass.open(folder, entry, loaded.engine, loaded.backend.vocab_size, loaded.threads),
    )
