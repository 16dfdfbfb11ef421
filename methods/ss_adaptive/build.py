"""Method ss-adaptive's build part: an acceptance head on the frozen SS model's stream states (train.py beside this
file), which picks each step's tree among the artifact's calibrated ones; installed as drafters/ss-adaptive."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streamfuse.adapters.acceptance import MANIFEST, read_acceptance_manifest
from streamfuse.export.artifact import ExportConfig, install_drafter
from streamfuse.methods.ss_adaptive.train import stream_acceptance_features
from streamfuse.training.acceptance import train_head
from streamfuse.training.build_part import MethodBuild
from streamfuse.training.stage import OutputFormat, Stage
from streamfuse.training.stages import target_stage

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build

ACCEPTANCE_HEAD = OutputFormat(MANIFEST, read_acceptance_manifest)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Method ss-adaptive: SpecDec++'s acceptance head on the SS model's stream states picks each step's tree among
    the calibrated ones. Trained on the frozen SS model's own answers (train.py beside this file); an existing
    artifact gets it added."""

    enabled: bool = False
    depth: int = 3  # residual blocks before the logit (0: linear)
    reject_weight: float = 1.0  # 1: a calibrated probability, which the expected-tokens choice needs
    epochs: float = 3.0
    learning_rate: float = 1e-3
    batch: int = 512
    unlabelled: bool = False  # the task's unlabelled inputs' own answers too

    def validate(self) -> None:
        if self.depth < 0 or self.batch < 1 or self.epochs <= 0 or self.reject_weight <= 0:
            raise ValueError(
                f"adaptive.depth must be >= 0, adaptive.batch >= 1 and adaptive.epochs, "
                f"adaptive.reject_weight > 0, got {self.depth}, {self.batch}, {self.epochs} and "
                f"{self.reject_weight}"
            )


def train(build: Build, ss_dir: Path, trained: dict[str, Path]) -> Path:
    """<run>/ss-adaptive: an acceptance head on the frozen SS model's stream states, over its own answers; keyed on
    the SS model whose streams it reads, its answers' length and its recipe (target_stage_inputs)."""
    config = build.config.section("adaptive")

    def extract(target, items, cache):
        return stream_acceptance_features(target, items, build.pad_id, cache)

    def fit(folder: Path, stage: Stage, target_key: str, features, items, answers: int) -> str:
        info = {"training_key": stage.key, "target": target_key, "answers": len(items)}
        return train_head("ss-adaptive", features, config, build.config.train.seed, folder, info, answers)

    return target_stage(build, ss_dir, "ss-adaptive", "adaptive", ACCEPTANCE_HEAD, "stream-acceptance", extract, fit)


def install(build: Build, artifact: Path, ss_dir: Path, trained: Path, export: ExportConfig) -> None:
    """drafters/ss-adaptive: the head (the artifact's trees and calibration are the choice's options)."""
    install_drafter(
        artifact, "ss-adaptive", trained, {"training_key": read_acceptance_manifest(trained)["info"]["training_key"]}
    )
    print(f"[ss-adaptive] acceptance head added to {artifact}/drafters/ss-adaptive", flush=True)


BUILD = MethodBuild("adaptive", AdaptiveConfig, train, install, cheap_trees=True)
