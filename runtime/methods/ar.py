"""Plain decoding: the root alone each step; every speed-up's baseline."""

from streamfuse.runtime.decode import default_drafter
from streamfuse.runtime.methods.method import Method

METHOD = Method("ar", "AR: plain decoding, one token per call",
                drafter=lambda loaded, settings: default_drafter(settings, loaded.backend),
                default_tree=lambda loaded: None)
