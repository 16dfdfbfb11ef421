"""Speculative Streaming: the target's own streams fill the draft tree its next verify pass checks."""

from streamfuse.runtime.methods.method import Method
from streamfuse.runtime.stream_drafter import StreamDrafter

METHOD = Method("ss", "SS: speculative streaming, the streams' drafts verified in the same call",
                drafter=lambda loaded, settings: StreamDrafter(settings.tree, loaded.backend.num_streams),
                default_tree=lambda loaded: loaded.tree, streams=True)
