"""Two-model speculative decoding: a small draft model's chain (its own artifact in drafters/sd), on the
target's engine where the build exported it for that engine, else on torch. SpecDec++ and PEARL draft with the
same draft model (its entry, NAME)."""

from streamfuse.methods.sd.drafter import ModelDrafter
from streamfuse.runtime.backends.base import Backend
from streamfuse.runtime.methods.method import Method, recorded_tree
from streamfuse.runtime.speculation.tree import TreeSpec

NAME = "sd"  # the method, and the artifact entry of its draft model


def draft_engine(loaded) -> Backend:
    """The draft model on the target's engine where it was exported for it and runs here, else on torch;
    loaded once per Loaded (with the loader it hands the methods, which import no loader)."""
    folder = loaded.artifact.drafter_path(NAME)
    engine = loaded.engine_for(folder)
    return loaded.cached(
        f"{NAME}:{engine}",
        lambda: loaded.loader(folder, engine, loaded.backend.device, threads=loaded.threads, calibrated=False).backend,
    )


def chain_of(value: str) -> dict:
    """sd:G, a chain of G >= 1 drafts."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"sd:G takes a whole number of drafts G >= 1, got {value!r}")
    return {"tree": TreeSpec.chain(int(value))}


METHOD = Method(
    NAME,
    "SD: two-model speculative decoding, a small draft model's chain",
    drafter=lambda loaded, settings: ModelDrafter(draft_engine(loaded), settings),
    default_tree=recorded_tree(NAME),
    build_flags="--set sd.enabled=true",
    artifact_entries=(NAME,),
    entry_needs=("tree",),
    chain=True,
    variant=chain_of,
)
