"""What a decoding method declares at run time, in one place: its name, the artifact entries it reads (and what
it needs in its own), its default tree, the shapes it verifies and its drafter factory.

The decode loop (runtime/request/decode.py) is the same for every method; a method only builds the drafter
(runtime/request/drafter.py) it runs with. The registry (runtime/methods/registry.py) lists them; the CLIs, the bench,
the profiler and the demo read it, so a new method is its own folder plus one registry line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from streamfuse.runtime.speculation.tree import TreeSpec

# Type names in the comments below: Loaded (runtime/request/loader.py), DecodeSettings (runtime/request/settings.py),
# Drafter (runtime/request/drafter.py) and Backend (runtime/backends/base.py), not imported here: the artifact's
# schema reads the registry, so the method table sits below the artifact, the engines and the request path.


def own_shape(tree: TreeSpec) -> list[TreeSpec]:
    return [tree]


def widths_tree(value: str) -> dict:
    """METHOD:W1-W2-.. (the fused drafters' and Medusa's variant): W_d children at depth d, under the depth d - 1
    node of the all-top path (the drafts' best guess), which is where acceptance goes deepest."""
    widths = value.split("-")
    if not all(w.isdigit() and int(w) >= 1 for w in widths):
        raise ValueError(f"METHOD:W1-W2-.. takes children per depth >= 1, got {value!r}")
    paths = [(0,) * depth + (rank,) for depth, width in enumerate(map(int, widths)) for rank in range(width)]
    return {"tree": TreeSpec(tuple(paths))}


def recorded_tree(entry: str) -> Callable:
    """A default_tree: the tree the build recorded in the artifact's drafters/<entry>."""
    return lambda loaded: TreeSpec.from_dict(loaded.artifact.drafters[entry]["tree"])


@dataclass(frozen=True)
class Method:
    name: str  # DecodeSettings.method, --method, the trace's method
    label: str  # one line for the CLIs' help and the demo's selector
    drafter: Callable[..., object]  # (Loaded, DecodeSettings) -> the drafter a run of this method decodes with
    default_tree: Callable[..., TreeSpec | None]  # Loaded -> its draft shape unless told otherwise (None: plain)
    build_flags: str | None = None  # the build flags that add its drafter to an artifact (None: always there)
    artifact_entries: tuple[str, ...] = ()  # the artifact's drafters/<entry> folders it reads
    entry_needs: tuple[str, ...] = ()  # what its own entry (drafters/<name>) must hold: the manifest schema checks
    streams: bool = False  # drafts from the target's own streams: calibrated step costs and the fallback apply
    chain: bool = False  # drafts a chain drawn from its own distribution (speculative sampling): no branching tree
    threshold: bool = False  # takes a stop threshold (--threshold)
    shapes: Callable[[TreeSpec], list[TreeSpec]] = own_shape  # every shape a run verifies, up to its tree
    # METHOD:VALUE in the bench's --methods: VALUE -> the DecodeSettings fields it sets (ValueError if bad)
    variant: Callable[[str], dict] | None = None
    # (DecodeSettings, Backend) -> its drafter from the target's engine alone, no artifact (decode.generate's own)
    engine_drafter: Callable[..., object] | None = None
    plain: bool = False  # plain decoding: every speed-up's baseline (exactly one method is)
    default: bool = False  # what the CLIs, the bench and the demo run unless told (exactly one method is)

    @property
    def speculative(self) -> bool:
        return not self.plain


def tree_drafter(name: str, label: str, drafter: Callable[..., object], entry_needs: tuple[str, ...]) -> Method:
    """A method whose drafter the build adds (--set <name>.enabled=true) as its own drafters/<name> entry, which
    holds its default tree (recorded_tree); METHOD:W1-W2-.. runs it on a tree of those widths (widths_tree)."""
    return Method(
        name,
        label,
        drafter=drafter,
        default_tree=recorded_tree(name),
        build_flags=f"--set {name}.enabled=true",
        artifact_entries=(name,),
        entry_needs=entry_needs,
        variant=widths_tree,
    )


def on_engine(make: Callable[..., object]) -> Callable[..., object]:
    """A Method.drafter from an engine_drafter: (Loaded, DecodeSettings) -> make(settings, loaded.backend)."""
    return lambda loaded, settings: make(settings, loaded.backend)
