"""Speculative Streaming: the target's own streams fill the draft tree its next verify pass checks."""

from streamfuse.methods.ss.drafter import StreamDrafter
from streamfuse.runtime.methods.method import Method, on_engine

NAME = "ss"  # the method, and the build's folder of the SS model (the target every method's drafter reads)


def engine_drafter(settings, backend) -> StreamDrafter:
    return StreamDrafter(settings.tree, backend.num_streams)


METHOD = Method(
    NAME,
    "SS: speculative streaming, the streams' drafts verified in the same call",
    drafter=on_engine(engine_drafter),
    default_tree=lambda loaded: loaded.tree,
    streams=True,
    engine_drafter=engine_drafter,
    default=True,
)
