"""Method specdec++'s build part: an acceptance head on sd's frozen draft model (train.py beside this file), which
decides each chain's length at run time; installed as drafters/specdec++."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streamfuse.adapters.acceptance import MANIFEST, read_acceptance_manifest
from streamfuse.adapters.checkpoint import load_checkpoint, read_manifest
from streamfuse.export.artifact import ExportConfig, install_drafter
from streamfuse.methods.specdec.train import acceptance_features
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.acceptance import train_head
from streamfuse.training.build_part import MethodBuild
from streamfuse.training.stage import OutputFormat, Stage, recipe
from streamfuse.training.stages import model_key

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build

ACCEPTANCE_HEAD = OutputFormat(MANIFEST, read_acceptance_manifest)
DRAFT = "sd"  # the section, and the method, whose draft model the head reads


@dataclass(frozen=True)
class SpecDecConfig:
    """SpecDec++, method specdec++ (adapters/acceptance.py): an acceptance head on sd's frozen draft
    model decides each chain's length, 2..max_drafts, stopping once P(a rejection) passes `threshold`.
    Trained on the draft model's states over the target's own answers (train.py beside this file).
    Needs sd.enabled; an existing artifact gets it added."""

    enabled: bool = False
    max_drafts: int = 8  # γ_max: the longest chain
    threshold: float = 0.5  # h, recorded in the artifact (the runtime's --threshold overrides it)
    depth: int = 3  # residual blocks before the logit (the paper's D; 0: linear)
    reject_weight: float = 6.0  # the paper's w_rej (w_acc = 1)
    epochs: float = 3.0
    learning_rate: float = 1e-3
    batch: int = 512

    def validate(self) -> None:
        if self.max_drafts < 2 or self.depth < 0 or self.batch < 1 or self.epochs <= 0 or self.reject_weight <= 0:
            raise ValueError(
                f"specdec.max_drafts must be >= 2, specdec.depth >= 0, specdec.batch >= 1 and "
                f"specdec.epochs, specdec.reject_weight > 0, got {self.max_drafts}, {self.depth}, "
                f"{self.batch}, {self.epochs} and {self.reject_weight}"
            )
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"specdec.threshold is a probability in [0, 1], got {self.threshold}")


def specdec_inputs(config, draft_key: str) -> dict:
    """The head depends on the draft model it reads and its recipe (not the threshold or γ_max: runtime choices)."""
    return {
        "draft": draft_key,
        "specdec": recipe(config.section("specdec"), "threshold", "max_drafts"),
        "seed": config.train.seed,
    }


def train(build: Build, ss_dir: Path, trained: dict[str, Path]) -> Path:
    """<run>/specdec: an acceptance head on sd's frozen draft model, over the SS model's own answers."""
    sd_dir = trained[DRAFT]
    draft_key = read_manifest(sd_dir)["info"]["training_key"]

    def run(folder: Path, stage: Stage) -> str:
        items, answers = build.target_answers(
            build.inference_model(ss_dir), model_key(ss_dir), build.config.section(DRAFT).unlabelled
        )
        draft, _, _ = load_checkpoint(sd_dir, build.args.base_model, merge_lora=True)
        cache = build.run_dir / "distill" / f"{draft_key}-acceptance.safetensors"
        features = acceptance_features(draft.eval(), items, cache)
        info = {"training_key": stage.key, "draft": draft_key, "answers": len(items)}
        return train_head(
            "specdec++", features, build.config.section("specdec"), build.config.train.seed, folder, info, answers
        )

    return Stage(
        "specdec++", build.run_dir / "specdec", "specdec", specdec_inputs(build.config, draft_key), ACCEPTANCE_HEAD, run
    ).output()


def install(build: Build, artifact: Path, ss_dir: Path, trained: Path, export: ExportConfig) -> None:
    """drafters/specdec++: the head, the chain of its longest and its stop threshold (sd's draft model drafts)."""
    config = build.config.section("specdec")
    install_drafter(
        artifact,
        "specdec++",
        trained,
        {
            "tree": TreeSpec.chain(config.max_drafts).to_dict(),
            "draft": DRAFT,
            "threshold": config.threshold,
            "training_key": read_acceptance_manifest(trained)["info"]["training_key"],
        },
    )
    print(f"[specdec++] acceptance head added to {artifact}/drafters/specdec++", flush=True)


BUILD = MethodBuild("specdec", SpecDecConfig, train, install, needs=(DRAFT,), chain=lambda config: config.max_drafts)
