"""PEARL: sd's draft model drafts in a worker process on its own core while the target verifies
(runtime/pearl_drafter.py): post-verify keeps drafting past the chain under verification, pre-verify checks the
first draft with a plain target step after a miss."""

from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.methods.sd import chain_of
from streamfuse.runtime.pearl_drafter import PearlDrafter, PearlWorker
from streamfuse.runtime.tree import TreeSpec


def worker(loaded) -> PearlWorker:
    """The draft model on the target's engine where the build exported it, else torch, always on the CPU (a
    target on a GPU leaves the CPU to the draft); spawned once per Loaded."""
    from streamfuse.runtime.loader import runnable_backends

    folder = loaded.artifact.drafter_path("sd")
    engine = loaded.engine if loaded.engine in runnable_backends(folder) else "torch"
    return loaded.cached(f"pearl:{engine}", lambda: PearlWorker(folder, engine))


METHOD = Method("pearl", "PEARL: sd's draft model drafting on its own core while the target verifies",
                drafter=lambda loaded, settings: PearlDrafter(worker(loaded), settings),
                default_tree=lambda loaded: TreeSpec.from_dict(loaded.artifact.drafters["sd"]["tree"]),
                build_flags="--set sd.enabled=true", artifact_entries=("sd",), chain=True, variant=chain_of)
