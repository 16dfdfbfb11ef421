"""Method parallelspec's build part: the one-layer drafter (model.py beside this file) trained group-wise on the
frozen SS model's states over its own greedy answers (train.py), its pass exported as a graph for each of the
artifact's engines (graph.py) and installed as drafters/parallelspec (methods/fused/stage.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from streamfuse.export.artifact import ExportConfig
from streamfuse.methods.fused.stage import fused_stage, install_fused
from streamfuse.methods.medusa.drafter import heads_tree
from streamfuse.methods.parallelspec.graph import export_drafter
from streamfuse.methods.parallelspec.model import FILES, ParallelSpecModel
from streamfuse.methods.parallelspec.train import DrafterTraining, train_drafter
from streamfuse.runtime.artifact.format import Artifact
from streamfuse.runtime.methods.method import widths_tree
from streamfuse.training.build_part import MethodBuild

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build


@dataclass(frozen=True)
class ParallelSpecConfig:
    """ParallelSpec, method parallelspec: a one-layer drafter with `masks` [MASK] inputs drafts masks + 1 depths of
    SS's tree in one pass, trained group-wise on the frozen SS model's states over its own greedy answers. Its head
    keeps the `vocab` tokens most frequent in those answers and their prompts (0: all). Exported beside the
    artifact's graphs with a cache of `capacity` rows (the answer's tokens: the drafter's cache starts at the
    prompt's end). Off unless enabled."""

    enabled: bool = False
    masks: int = 3
    vocab: int = 8192
    # the paper: 20 epochs at 5e-4 on 68k conversations; on dialogsum's 981 own answers 10 at 1.5e-3 drafted
    # better on held-out answers than 3 at 5e-4
    epochs: float = 10.0
    learning_rate: float = 1.5e-3
    items: int = 8  # answers per step
    decay: float = 0.8  # [MASK]_j's loss weight is decay^j
    capacity: int = 256
    # ExecuTorch's pass: "none" (fp32) or "int8" (weights per channel, int8 activations; ONNX stays fp32): no
    # faster overall here (docs/benchmarks.md)
    quantize: str = "none"
    tree: str = "2-1"  # children per depth along the top path (widths_tree); "": SS's tree cut
    unlabelled: bool = False  # the task's unlabelled inputs' own answers too

    def validate(self) -> None:
        if self.tree and widths_tree(self.tree)["tree"].depth > self.masks + 1:
            raise ValueError(
                f"parallelspec.tree {self.tree!r} is deeper than the {self.masks + 1} depths a pass "
                f"drafts (parallelspec.masks + 1): shorten it or raise parallelspec.masks"
            )
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"parallelspec.quantize must be none or int8, got {self.quantize!r}")
        if self.masks < 1 or self.items < 1 or self.epochs <= 0 or self.vocab < 0 or self.capacity < 8:
            raise ValueError(
                f"parallelspec.masks and parallelspec.items must be >= 1, parallelspec.epochs > 0, "
                f"parallelspec.vocab >= 0 and parallelspec.capacity >= 8, got {self.masks}, "
                f"{self.items}, {self.epochs}, {self.vocab} and {self.capacity}"
            )


# What the drafter's stage key leaves out of its recipe: the exported cache's capacity, its format and its tree.
RUNTIME_CHOICES = ("capacity", "tree", "quantize")


def train(build: Build, ss_dir: Path, trained: dict[str, Path]) -> Path:
    """<run>/parallelspec: the drafter, its head pruned to the parallelspec.vocab tokens most frequent in the SS
    model's own answers and their prompts."""
    config = build.config.section("parallelspec")
    training = DrafterTraining(config.epochs, config.learning_rate, config.items, config.decay, build.config.train.seed)
    make, fit = partial(ParallelSpecModel.like, size=config.masks), partial(train_drafter, config=training)
    return fused_stage(build, ss_dir, "parallelspec", FILES, make, fit, *RUNTIME_CHOICES)


def install(build: Build, artifact: Path, ss_dir: Path, trained: Path, export: ExportConfig) -> None:
    """Its graphs (reused while the drafter, capacity, format and engines are the same) and tree as
    drafters/parallelspec: parallelspec.tree, or SS's tree cut to the depths a pass drafts."""
    config = build.config.section("parallelspec")

    def write(model, embed, engines: list[str], folder: Path) -> dict:
        return export_drafter(
            FILES.load(trained, model), embed, config.masks + 2, config.capacity, engines, folder, config.quantize
        )

    tree = (
        widths_tree(config.tree)["tree"] if config.tree else heads_tree(Artifact.open(artifact).tree, config.masks + 1)
    )
    entry = install_fused(
        build, artifact, "parallelspec", FILES, trained, ss_dir, export, [config.capacity, config.quantize], write, tree
    )
    print(
        f"[parallelspec] drafter added to {artifact}/drafters/parallelspec (tree of {tree.num_nodes} nodes, "
        f"graph parity {entry['parity']})",
        flush=True,
    )


BUILD = MethodBuild("parallelspec", ParallelSpecConfig, train, install)
