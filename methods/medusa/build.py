"""Method medusa's build part: heads (model.py beside this file) trained on the frozen SS model's states over its
own greedy answers; the artifact's graphs get them as a heads method, and drafters/medusa records their tree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamfuse.adapters.checkpoint import load_checkpoint
from streamfuse.export.artifact import ExportConfig, install_drafter
from streamfuse.methods.medusa.drafter import heads_tree
from streamfuse.methods.medusa.model import MANIFEST, MedusaHeads, read_heads_manifest, save_heads
from streamfuse.methods.medusa.train import HeadTraining, head_features, train_heads
from streamfuse.runtime.artifact.format import Artifact
from streamfuse.training.build_part import MethodBuild
from streamfuse.training.stage import OutputFormat, Stage
from streamfuse.training.stages import target_stage

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build

HEADS = OutputFormat(MANIFEST, read_heads_manifest)


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa heads, method medusa: `heads` residual blocks on the frozen SS model's last hidden state, trained on
    its states over its own greedy answers (Medusa-1, shared with sd: the same cached answers). Off unless enabled;
    an existing artifact gets them added."""

    enabled: bool = False
    heads: int = 3
    epochs: float = 2.0
    learning_rate: float = 1e-3
    batch: int = 256  # answer positions per step
    unlabelled: bool = False  # the task's unlabelled inputs' own answers too

    def validate(self) -> None:
        if self.heads < 1 or self.batch < 1 or self.epochs <= 0:
            raise ValueError(
                f"medusa.heads and medusa.batch must be >= 1 and medusa.epochs > 0, got {self.heads}, "
                f"{self.batch} and {self.epochs}"
            )


def train(build: Build, ss_dir: Path, trained: dict[str, Path]) -> Path:
    """<run>/medusa: heads on the frozen SS model's states over its own answers (Medusa-1); keyed on the target
    whose states they read, its answers' length and their recipe (target_stage_inputs)."""
    config = build.config.section("medusa")

    def extract(target, items, cache):
        return head_features(target, items, config.heads, cache)

    def fit(folder: Path, stage: Stage, target_key: str, features, items, answers: int) -> str:
        torch.manual_seed(build.config.train.seed)
        heads = MedusaHeads(config.heads, features.hidden.shape[1])
        training = HeadTraining(config.epochs, config.learning_rate, config.batch, seed=build.config.train.seed)
        # The features' target was packed: its kernels pass no gradient, so train through the eager head.
        eager, _, _ = load_checkpoint(ss_dir, build.args.base_model, merge_lora=True)
        result = train_heads(heads, eager.parts.lm_head, features, training)
        save_heads(heads, folder, {"training_key": stage.key, "target": target_key, "answers": len(items), **result})
        return (
            f"{result['seconds'] / 60:.1f} min on {len(features.hidden)} positions of {len(items)} of "
            f"{answers} own answers"
        )

    return target_stage(build, ss_dir, "medusa", "medusa", HEADS, f"medusa{config.heads}", extract, fit)


def install(build: Build, artifact: Path, ss_dir: Path, medusa_dir: Path, export: ExportConfig) -> None:
    """drafters/medusa: the heads (the graphs carry them already) and SS's tree cut to their depth."""
    heads = build.config.section("medusa").heads
    tree = heads_tree(Artifact.open(artifact).tree, heads)
    training_key = read_heads_manifest(medusa_dir)["info"]["training_key"]
    entry = {"tree": tree.to_dict(), "heads": heads, "training_key": training_key}
    install_drafter(artifact, "medusa", medusa_dir, entry)
    print(f"[medusa] heads added to {artifact}/drafters/medusa (tree of {tree.num_nodes} nodes)", flush=True)


BUILD = MethodBuild("medusa", MedusaConfig, train, install, heads=lambda folder: folder)
