"""SpecDec++: sd's draft model with an acceptance head that stops each chain once a rejection gets likely
(drafter.py's StopRule on methods/sd/drafter.py's ModelDrafter)."""

from dataclasses import replace

from streamfuse.methods import sd
from streamfuse.methods.sd.drafter import ModelDrafter
from streamfuse.methods.specdec.drafter import StopRule
from streamfuse.runtime.methods.method import Method, recorded_tree
from streamfuse.runtime.speculation.acceptance_head import load_acceptance_predictor
from streamfuse.runtime.speculation.tree import TreeSpec

NAME = StopRule.method


def drafter(loaded, settings) -> ModelDrafter:
    entry = loaded.artifact.drafters[NAME]
    rule = loaded.cached(
        NAME,
        lambda: StopRule(load_acceptance_predictor(loaded.artifact.drafter_path(NAME), "specdec"), entry["threshold"]),
    )
    if settings.threshold is not None:
        rule = replace(rule, threshold=settings.threshold)
    return ModelDrafter(sd.draft_engine(loaded), settings, rule)


def chains(tree: TreeSpec) -> list[TreeSpec]:
    """It verifies chains of 2 drafts up to its longest."""
    return [TreeSpec.chain(n) for n in range(2, tree.depth + 1)]


def with_threshold(value: str) -> dict:
    """specdec++:H, stop threshold 0 <= H <= 1."""
    try:
        threshold = float(value)
    except ValueError:
        threshold = -1.0
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"specdec++:H takes a stop threshold 0 <= H <= 1, got {value!r}")
    return {"threshold": threshold}


METHOD = Method(
    NAME,
    "SpecDec++: sd's draft model, each chain's length chosen by an acceptance head",
    drafter=drafter,
    default_tree=recorded_tree(NAME),
    build_flags="--set sd.enabled=true --set specdec.enabled=true",
    artifact_entries=(sd.NAME, NAME),
    entry_needs=("tree", "threshold"),
    chain=True,
    threshold=True,
    shapes=chains,
    variant=with_threshold,
)
