"""Plain decoding: the root alone each step; every speed-up's baseline."""

from streamfuse.methods.ar.drafter import PlainDrafter
from streamfuse.runtime.methods.method import Method, on_engine


def engine_drafter(settings, backend) -> PlainDrafter:
    return PlainDrafter()


METHOD = Method(
    "ar",
    "AR: plain decoding, one token per call",
    drafter=on_engine(engine_drafter),
    default_tree=lambda loaded: None,
    engine_drafter=engine_drafter,
    plain=True,
)
