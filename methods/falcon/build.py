"""Method falcon's build part: the semi-autoregressive one-layer drafter (model.py beside this file) trained with
CSGD on the frozen SS model's states over its own greedy answers (train.py), its pass exported as a graph for each
of the artifact's engines (graph.py) and installed as drafters/falcon (methods/fused/stage.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from streamfuse.export.artifact import ExportConfig
from streamfuse.methods.falcon.graph import export_drafter
from streamfuse.methods.falcon.model import FILES, FalconModel
from streamfuse.methods.falcon.train import FalconTraining, train_falcon
from streamfuse.methods.fused.stage import fused_stage, install_fused
from streamfuse.runtime.methods.method import widths_tree
from streamfuse.training.build_part import MethodBuild

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build


@dataclass(frozen=True)
class FalconConfig:
    """Falcon, method falcon (model.py beside this file): a one-layer semi-autoregressive drafter drafts `block`
    (k) depths of its tree per pass, the passes fed its own predicted states and top tokens, trained on the frozen
    SS model's states over its own greedy answers with CSGD (train.py; glance=false: teacher forcing, the ablation).
    Its head keeps the `vocab` most frequent tokens. Exported beside the artifact's graphs with a cache of
    `capacity` rows plus scratch for `max_passes` passes. Off unless enabled."""

    enabled: bool = False
    block: int = 2  # k, the paper's
    passes: int = 2  # blocks per training group: what later passes learn to read (m at run time is the tree's)
    glance: bool = True
    vocab: int = 8192
    epochs: float = 6.0
    learning_rate: float = 1.5e-3
    items: int = 8  # answers per step
    distill_weight: float = 0.1  # SmoothL1 + w (0.9 KL + 0.1 CE): the paper's w
    capacity: int = 256
    max_passes: int = 4  # the graphs' scratch: trees up to max_passes * block deep run without re-export
    quantize: str = "none"  # ExecuTorch's pass: "none" or "int8" (as parallelspec.quantize)
    # children per depth along the top path (widths_tree): one pass; deeper trees accept more but cost the 4-bit
    # target more than they repay on a CPU (docs/benchmarks.md, the k x m sweep)
    tree: str = "2-1"
    unlabelled: bool = False  # the task's unlabelled inputs' own answers too

    def validate(self) -> None:
        if (
            self.block < 1
            or self.passes < 1
            or self.max_passes < 1
            or self.items < 1
            or self.epochs <= 0
            or self.vocab < 0
            or self.capacity < 8
        ):
            raise ValueError(
                f"falcon.block, falcon.passes, falcon.max_passes and falcon.items must be >= 1, "
                f"falcon.epochs > 0, falcon.vocab >= 0 and falcon.capacity >= 8, got {self.block}, "
                f"{self.passes}, {self.max_passes}, {self.items}, {self.epochs}, {self.vocab} and "
                f"{self.capacity}"
            )
        if widths_tree(self.tree)["tree"].depth > self.max_passes * self.block:
            raise ValueError(
                f"falcon.tree {self.tree!r} is deeper than falcon.max_passes x falcon.block = "
                f"{self.max_passes * self.block}: shorten it or raise falcon.max_passes"
            )
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"falcon.quantize must be none or int8, got {self.quantize!r}")


# What the drafter's stage key leaves out of its recipe: the exported cache, its scratch, its format and its tree.
RUNTIME_CHOICES = ("capacity", "max_passes", "tree", "quantize")


def train(build: Build, ss_dir: Path, trained: dict[str, Path]) -> Path:
    """<run>/falcon: the drafter (CSGD), its head pruned to the falcon.vocab tokens most frequent in the SS model's
    own answers and their prompts."""
    config = build.config.section("falcon")
    training = FalconTraining(
        config.epochs,
        config.learning_rate,
        config.items,
        config.passes,
        config.glance,
        distill_weight=config.distill_weight,
        seed=build.config.train.seed,
    )
    make, fit = partial(FalconModel.like, size=config.block), partial(train_falcon, config=training)
    return fused_stage(build, ss_dir, "falcon", FILES, make, fit, *RUNTIME_CHOICES)


def install(build: Build, artifact: Path, ss_dir: Path, trained: Path, export: ExportConfig) -> None:
    """Its graphs (reused while the drafter, capacity, scratch, format and engines are the same) and falcon.tree as
    drafters/falcon."""
    config = build.config.section("falcon")

    def write(model, embed, engines: list[str], folder: Path) -> dict:
        return export_drafter(
            FILES.load(trained, model),
            embed,
            config.block + 2,
            config.capacity,
            config.max_passes,
            engines,
            folder,
            config.quantize,
        )

    tree = widths_tree(config.tree)["tree"]
    entry = install_fused(
        build,
        artifact,
        "falcon",
        FILES,
        trained,
        ss_dir,
        export,
        [config.capacity, config.max_passes, config.quantize],
        write,
        tree,
    )
    print(
        f"[falcon] drafter added to {artifact}/drafters/falcon (k = {entry['block']}, tree of {tree.num_nodes} "
        f"nodes, graph parity {entry['parity']})",
        flush=True,
    )


BUILD = MethodBuild("falcon", FalconConfig, train, install)
