"""Falcon: a semi-autoregressive one-layer drafter drafts k depths of the tree per pass, m passes a step
(drafter.py); its pass runs on the target's engine (its own graph in the artifact, graph_pass.py) or, for a torch
target, in torch (torch_pass.py). The fused-drafter base it shares with ParallelSpec: methods/fused/."""

from streamfuse.methods.falcon.drafter import FalconDrafter
from streamfuse.methods.falcon.graph_pass import GraphFalconPass
from streamfuse.methods.fused import draft_pass
from streamfuse.runtime.methods.method import tree_drafter

NAME = "falcon"


def drafter(loaded, settings) -> FalconDrafter:
    entry = loaded.artifact.drafters[NAME]
    max_passes = entry["max_passes"] if loaded.engine != "torch" else None  # a graph's scratch is static
    return FalconDrafter(
        draft_pass(loaded, NAME, GraphFalconPass), settings.tree, settings.sampling, settings.seed, max_passes
    )


METHOD = tree_drafter(
    NAME,
    "Falcon: a semi-autoregressive one-layer drafter, k depths per pass, m passes a step",
    drafter,
    ("tree", "graphs", "embedding", "vocab_file", "block", "rows", "slots", "cache", "max_passes"),
)
