"""What a method adds to the build, declared as `BUILD` in its folder's `build.py`: the build (training/pipeline.py)
iterates these and names no method.

A build part has a config section of its own (`--set <section>.enabled=true` turns it on; the section's dataclass
has `enabled` and `validate()`), a training stage that makes its trained folder from the SS model (and the trained
folders of the parts it needs), and an install that puts its drafter into a built artifact (its folder under
drafters/ and its manifest entry). It may add to the main export (Medusa's heads become a graph method), verify
chains longer than the streams (the export then gets a bucket that holds them) or choose each step's tree among
the artifact's (calibration then keeps cheap trees too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamfuse.runtime.methods import registry

if TYPE_CHECKING:  # types only
    from streamfuse.export.artifact import ExportConfig
    from streamfuse.training.build_state import BuildState


@dataclass(frozen=True)
class MethodBuild:
    section: str  # its config section: BuildConfig.section(section), --set <section>.FIELD=VALUE
    config: type  # the section's dataclass: every field defaulted, `enabled`, `validate()`
    # train(build, ss_dir, trained) -> its trained folder (a training/stage.py Stage's output); trained: the
    # folders of the sections it needs, by section
    train: Callable[[BuildState, Path, dict[str, Path]], Path]
    # install(build, artifact, ss_dir, its trained folder, the artifact's export settings): its drafter into
    # <artifact>/drafters/ and the manifest, one log line
    install: Callable[[BuildState, Path, Path, Path, ExportConfig], None]
    needs: tuple[str, ...] = ()  # sections whose trained folders it reads (each must be enabled with it)
    chain: Callable[[Any], int] | None = None  # section -> the longest chain of drafts it verifies
    heads: Callable[[Path], Path] | None = None  # its trained folder -> Medusa-style heads the main graphs carry
    cheap_trees: bool = False  # it picks each step's tree among the artifact's: calibration keeps cheap ones too

    def settings(self, config) -> Any:
        """Its section of a BuildConfig."""
        return config.section(self.section)


def parts() -> list[MethodBuild]:
    """Every registered method's build part, in the registry's order, each after the parts it needs."""
    found = [module.BUILD for name in registry.names() if (module := registry.part(name, "build")) is not None]
    by_section = {part.section: part for part in found}
    ordered: list[MethodBuild] = []

    def place(part: MethodBuild, seen: tuple[str, ...] = ()) -> None:
        if part in ordered:
            return
        if part.section in seen:
            raise ValueError(f"build sections {' -> '.join((*seen, part.section))} need each other in a circle")
        for need in part.needs:
            if need not in by_section:
                raise ValueError(f"build section {part.section} needs section {need}, which no method declares")
            place(by_section[need], (*seen, part.section))
        ordered.append(part)

    for part in found:
        place(part)
    return ordered


def part(section: str) -> MethodBuild:
    """The build part of a config section."""
    for candidate in parts():
        if candidate.section == section:
            return candidate
    raise KeyError(section)


def enabled(config) -> list[MethodBuild]:
    """The parts a BuildConfig turns on, in build order."""
    return [candidate for candidate in parts() if candidate.settings(config).enabled]


def longest_chain(config) -> int:
    """The longest chain of drafts an enabled part verifies (0: none)."""
    return max(
        (candidate.chain(candidate.settings(config)) for candidate in enabled(config) if candidate.chain), default=0
    )
