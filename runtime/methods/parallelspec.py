"""ParallelSpec: a one-layer drafter drafts every depth of a static tree in one pass (runtime/parallel_drafter.py);
its pass runs on the target's engine (its own graph in the artifact) or, for a torch target, in torch."""

from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.parallel_drafter import ParallelDrafter
from streamfuse.runtime.tree import TreeSpec


def draft_pass(loaded):
    """The drafter pass for the loaded target, made once per Loaded."""
    def torch_pass(folder, model):
        from streamfuse.adapters.parallelspec import load_drafter
        from streamfuse.runtime.backends.parallel_torch import TorchParallelPass

        return TorchParallelPass(load_drafter(folder, model.model), model.parts.embed, model.parts.vocab_size,
                                 loaded.backend.device, loaded.backend.dtype)

    def graph_pass(folder, entry):
        from streamfuse.runtime.backends.parallel_graph import GraphParallelPass

        return GraphParallelPass.open(folder, entry, loaded.engine, loaded.backend.vocab_size, loaded.threads)
    return engine_pass(loaded, "parallelspec", torch_pass, graph_pass)


def engine_pass(loaded, method: str, torch_pass, graph_pass):
    """A fused drafter's pass (ParallelSpec's, Falcon's) for the loaded target, made once per Loaded: on torch,
    torch_pass(drafter folder, target model); else graph_pass(drafter folder, manifest entry), the artifact's
    graph of the drafter for the target's engine."""
    entry, folder = loaded.artifact.drafters[method], loaded.artifact.drafter_path(method)
    if loaded.engine == "torch":
        return loaded.cached(f"{method}:torch", lambda: torch_pass(folder, loaded.backend.model))
    if loaded.engine not in entry.get("graphs", {}):
        raise ValueError(f"method {method}: {loaded.artifact.path} has no {loaded.engine} graph of its drafter (it "
                         f"has {', '.join(entry.get('graphs', {})) or 'none'}); rebuild it with export/build.py "
                         f"--set {method}.enabled=true, or pass --backend torch")
    return loaded.cached(f"{method}:{loaded.engine}", lambda: graph_pass(folder, entry))


def widths_tree(value: str) -> dict:
    """parallelspec:W1-W2-.. (falcon:W1-W2-.. too): W_d children at depth d, under the depth d - 1 node of the
    all-top path (the drafts' best guess), which is where acceptance goes deepest."""
    widths = value.split("-")
    if not all(w.isdigit() and int(w) >= 1 for w in widths):
        raise ValueError(f"METHOD:W1-W2-.. takes children per depth >= 1, got {value!r}")
    paths = [(0,) * depth + (rank,) for depth, width in enumerate(map(int, widths)) for rank in range(width)]
    return {"tree": TreeSpec(tuple(paths))}


def default_tree(loaded) -> TreeSpec:
    """The tree the build recorded: parallelspec.tree, or SS's calibrated tree cut to the depths one pass drafts."""
    return TreeSpec.from_dict(loaded.artifact.drafters["parallelspec"]["tree"])


METHOD = Method("parallelspec", "ParallelSpec: a one-layer drafter drafts every depth of the tree in one pass",
                drafter=lambda loaded, settings: ParallelDrafter(draft_pass(loaded), settings.tree, settings.sampling,
                                                                 settings.seed),
                default_tree=default_tree, build_flags="--set parallelspec.enabled=true",
                artifact_entries=("parallelspec",), variant=widths_tree)
