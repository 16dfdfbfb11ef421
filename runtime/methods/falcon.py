"""Falcon: a semi-autoregressive one-layer drafter drafts k depths of the tree per pass, m passes a step
(runtime/falcon_drafter.py); its pass runs on the target's engine (its own graph in the artifact) or, for a
torch target, in torch."""

from streamfuse.runtime.falcon_drafter import FalconDrafter
from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.methods.parallelspec import engine_pass, widths_tree
from streamfuse.runtime.tree import TreeSpec


def draft_pass(loaded):
    """The drafter pass for the loaded target, made once per Loaded."""
    def torch_pass(folder, model):
        from streamfuse.adapters.falcon import load_drafter
        from streamfuse.runtime.backends.falcon_torch import TorchFalconPass

        return TorchFalconPass(load_drafter(folder, model.model), model.parts.embed, model.parts.vocab_size,
                               loaded.backend.device, loaded.backend.dtype)

    def graph_pass(folder, entry):
        from streamfuse.runtime.backends.falcon_graph import GraphFalconPass

        return GraphFalconPass.open(folder, entry, loaded.engine, loaded.backend.vocab_size, loaded.threads)
    return engine_pass(loaded, "falcon", torch_pass, graph_pass)


def drafter(loaded, settings) -> FalconDrafter:
    entry = loaded.artifact.drafters["falcon"]
    max_passes = entry["max_passes"] if loaded.engine != "torch" else None  # a graph's scratch is static
    return FalconDrafter(draft_pass(loaded), settings.tree, settings.sampling, settings.seed, max_passes)


def default_tree(loaded) -> TreeSpec:
    """The tree the build recorded (falcon.tree)."""
    return TreeSpec.from_dict(loaded.artifact.drafters["falcon"]["tree"])


METHOD = Method("falcon", "Falcon: a semi-autoregressive one-layer drafter, k depths per pass, m passes a step",
                drafter=drafter, default_tree=default_tree, build_flags="--set falcon.enabled=true",
                artifact_entries=("falcon",), variant=widths_tree)
