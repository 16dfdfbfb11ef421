"""ss-adaptive: SS's streams, each step in the calibrated tree an acceptance head on the streams' states
expects the most tokens per unit of step cost from (drafter.py, runtime/speculation/tree_choice.py)."""

from streamfuse.methods.ss_adaptive.drafter import AdaptiveStreamDrafter
from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.speculation.acceptance_head import load_acceptance_predictor

NAME = "ss-adaptive"


def drafter(loaded, settings) -> AdaptiveStreamDrafter:
    head = loaded.cached(NAME, lambda: load_acceptance_predictor(loaded.artifact.drafter_path(NAME), "adaptive"))
    return AdaptiveStreamDrafter(loaded.tree_choice(settings.tree.num_nodes), head, loaded.backend.num_streams)


METHOD = Method(
    NAME,
    "SS-adaptive: SS with each step's tree chosen by an acceptance head on the streams",
    drafter=drafter,
    default_tree=lambda loaded: loaded.tree_choice().largest,
    build_flags="--set adaptive.enabled=true",
    artifact_entries=(NAME,),
    streams=True,
)
