"""What a decoding method declares, in one place: its name, the build section that adds its drafter, the
artifact entries it reads, its default tree, the shapes it verifies and its drafter factory.

The decode loop (runtime/decode.py) is the same for every method; a method only builds the drafter
(runtime/drafter.py) it runs with. The registry (runtime/methods/__init__.py) lists them; the CLIs, the
bench, the profiler and the demo read it, so a new method is its own file plus one registry line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamfuse.runtime.tree import TreeSpec

if TYPE_CHECKING:  # types only: the loader imports the registry
    from streamfuse.runtime.drafter import Drafter
    from streamfuse.runtime.loader import Loaded
    from streamfuse.runtime.settings import DecodeSettings


def own_shape(tree: TreeSpec) -> list[TreeSpec]:
    return [tree]


@dataclass(frozen=True)
class Method:
    name: str  # DecodeSettings.method, --method, the trace's method
    label: str  # one line for the CLIs' help and the demo's selector
    drafter: Callable[["Loaded", "DecodeSettings"], "Drafter"]  # the drafter a run of this method decodes with
    default_tree: Callable[["Loaded"], TreeSpec | None]  # its draft shape unless told otherwise (None: plain)
    build_flags: str | None = None  # export/build.py flags that add its drafter to an artifact (None: always there)
    artifact_entries: tuple[str, ...] = ()  # the artifact's drafters/<entry> folders it reads
    streams: bool = False  # drafts from the target's own streams: calibrated step costs and the fallback apply
    chain: bool = False  # drafts a chain drawn from its own distribution (speculative sampling): no branching tree
    threshold: bool = False  # takes a stop threshold (--threshold)
    shapes: Callable[[TreeSpec], list[TreeSpec]] = own_shape  # every shape a run verifies, up to its tree
    # METHOD:VALUE in the bench's --methods: VALUE -> the DecodeSettings fields it sets (ValueError if bad)
    variant: Callable[[str], dict] | None = None

    @property
    def speculative(self) -> bool:
        return self.name != "ar"
