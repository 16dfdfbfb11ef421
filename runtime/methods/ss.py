"""Speculative Streaming: the target's own streams fill the draft tree its next verify pass checks."""

from streamfuse.runtime.decode import default_drafter
from streamfuse.runtime.methods.method import Method

METHOD = Method("ss", "SS: speculative streaming, the streams' drafts verified in the same call",
                drafter=lambda loaded, settings: default_drafter(settings, loaded.backend),
                default_tree=lambda loaded: loaded.tree, streams=True)
