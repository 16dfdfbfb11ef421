"""Two-model speculative decoding: a small draft model's chain (its own artifact in drafters/sd), on the
target's engine where the build exported it for that engine, else on torch."""

from streamfuse.runtime.backends.base import Backend
from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.model_drafter import ModelDrafter
from streamfuse.runtime.tree import TreeSpec


def draft_engine(loaded) -> Backend:
    """The draft model on the target's engine where it was exported for it and runs here, else on torch;
    loaded once per Loaded."""
    from streamfuse.runtime.loader import load, runnable_backends

    folder = loaded.artifact.drafter_path("sd")
    engine = loaded.engine if loaded.engine in runnable_backends(folder) else "torch"
    return loaded.cached(f"sd:{engine}", lambda: load(folder, engine, loaded.backend.device, threads=loaded.threads,
                                                      calibrated=False).backend)


def chain_of(value: str) -> dict:
    """sd:G, a chain of G >= 1 drafts."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"sd:G takes a whole number of drafts G >= 1, got {value!r}")
    return {"tree": TreeSpec.chain(int(value))}


METHOD = Method("sd", "SD: two-model speculative decoding, a small draft model's chain",
                drafter=lambda loaded, settings: ModelDrafter(draft_engine(loaded), settings),
                default_tree=lambda loaded: TreeSpec.from_dict(loaded.artifact.drafters["sd"]["tree"]),
                build_flags="--set sd.enabled=true", artifact_entries=("sd",), chain=True, variant=chain_of)
