"""Plain decoding: the root alone each step; every speed-up's baseline."""

from streamfuse.runtime.drafter import PlainDrafter
from streamfuse.runtime.methods.method import Method

METHOD = Method("ar", "AR: plain decoding, one token per call", drafter=lambda loaded, settings: PlainDrafter(),
                default_tree=lambda loaded: None)
