"""PEARL: sd's draft model drafts in a worker process on its own core while the target verifies (drafter.py):
post-verify keeps drafting past the chain under verification, pre-verify checks the first draft with a plain
target step after a miss."""

from streamfuse.methods import sd
from streamfuse.methods.pearl.drafter import PearlDrafter, PearlWorker
from streamfuse.runtime.methods.method import Method, recorded_tree

NAME = "pearl"


def worker(loaded) -> PearlWorker:
    """The draft model on the target's engine where the build exported it, else torch, always on the CPU (a
    target on a GPU leaves the CPU to the draft); spawned once per Loaded."""
    folder = loaded.artifact.drafter_path(sd.NAME)
    engine = loaded.engine_for(folder)
    return loaded.cached(f"{NAME}:{engine}", lambda: PearlWorker(folder, engine, loaded.loader))


METHOD = Method(
    NAME,
    "PEARL: sd's draft model drafting on its own core while the target verifies",
    drafter=lambda loaded, settings: PearlDrafter(worker(loaded), settings),
    default_tree=recorded_tree(sd.NAME),
    build_flags="--set sd.enabled=true",
    artifact_entries=(sd.NAME,),
    chain=True,
    variant=sd.chain_of,
)
