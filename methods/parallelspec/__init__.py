"""ParallelSpec: a one-layer drafter drafts every depth of a static tree in one pass (drafter.py); its pass runs on
the target's engine (its own graph in the artifact, graph_pass.py) or, for a torch target, in torch
(torch_pass.py). The fused-drafter base it shares with Falcon: methods/fused/."""

from streamfuse.methods.fused import draft_pass
from streamfuse.methods.parallelspec.drafter import ParallelDrafter
from streamfuse.methods.parallelspec.graph_pass import GraphParallelPass
from streamfuse.runtime.methods.method import tree_drafter

NAME = "parallelspec"


def drafter(loaded, settings) -> ParallelDrafter:
    return ParallelDrafter(draft_pass(loaded, NAME, GraphParallelPass), settings.tree, settings.sampling, settings.seed)


# default tree: the one the build recorded (parallelspec.tree, or SS's calibrated tree cut to one pass's depths)
METHOD = tree_drafter(
    NAME,
    "ParallelSpec: a one-layer drafter drafts every depth of the tree in one pass",
    drafter,
    ("tree", "graphs", "embedding", "vocab_file", "masks", "rows", "capacity", "cache"),
)
