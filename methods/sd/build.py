"""Method sd's build part: the draft model (model.py beside this file) trained on the SS model's own greedy answers,
exported like the target to its own small artifact and installed as drafters/sd."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamfuse.adapters.base_model import load_base_model
from streamfuse.adapters.checkpoint import read_manifest
from streamfuse.adapters.config import LoraSettings
from streamfuse.export.artifact import ArtifactBuilder, ExportConfig, install_drafter
from streamfuse.methods.sd.model import draft_model
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training.build_part import MethodBuild, longest_chain
from streamfuse.training.stage import Stage, recipe
from streamfuse.training.stages import CHECKPOINT, model_key, train_and_save

if TYPE_CHECKING:
    from streamfuse.training.config import TrainConfig
    from streamfuse.training.pipeline import Build


@dataclass(frozen=True)
class DraftModelConfig:
    """Two-model speculative decoding, method sd: the base's first `layers` decoder layers with LoRA, trained on
    the SS model's own greedy answers (the tokens verification accepts). Off unless enabled: it adds those answers'
    generation and its own training to the build, and an existing artifact gets it added without redoing SS."""

    enabled: bool = False
    layers: int = 4
    gamma: int = 4  # drafts per step, the chain the artifact records for it
    lora_rank: int = 32
    epochs: float = 1.0
    learning_rate: float = 1e-3
    unlabelled: bool = False  # the task's unlabelled inputs' own answers too
    # Its exported LM head's rows: the `vocab` tokens most frequent in the SS model's own answers and their prompts
    # (FR-Spec), so a draft call reads that many rows instead of all V (the head is 2/3 of a 4-layer call). 0: all.
    vocab: int = 8192

    def validate(self) -> None:
        if self.layers < 2 or self.gamma < 1 or self.lora_rank < 1:
            raise ValueError(
                f"sd.layers must be >= 2, sd.gamma and sd.lora_rank >= 1, got {self.layers}, "
                f"{self.gamma} and {self.lora_rank}"
            )
        if self.vocab < 0:
            raise ValueError(f"sd.vocab must be >= 0 (0: the draft head keeps every token), got {self.vocab}")

    def lora(self) -> LoraSettings:
        return LoraSettings(rank=self.lora_rank, alpha=2.0 * self.lora_rank, dropout=0.0)

    def train_config(self, base: TrainConfig) -> TrainConfig:
        return replace(base, epochs=self.epochs, learning_rate=self.learning_rate, stream_weight=0.0)


def sd_inputs(config, target_key: str) -> dict:
    """The draft model depends on the target whose answers it learns, their length and its recipe (not
    gamma: how many it drafts per step is the runtime's choice; not vocab: the export prunes its head)."""
    return {
        "target": target_key,
        "sd": recipe(config.section("sd"), "gamma", "vocab"),
        "train": asdict(config.train),
        "answer_tokens": config.data.max_target_tokens,
    }


def train(build: Build, ss_dir: Path, trained: dict[str, Path]) -> Path:
    """<run>/sd: the base's first layers with LoRA, trained on the SS model's own greedy answers."""
    sd, target_key = build.config.section("sd"), model_key(ss_dir)

    def run(folder: Path, stage: Stage) -> str:
        items, answers = build.target_answers(build.inference_model(ss_dir), target_key, sd.unlabelled)
        base, _ = load_base_model(build.args.base_model)
        torch.manual_seed(build.config.train.seed)
        model = draft_model(base, sd.layers, sd.lora())
        info = {
            "task": build.task.name,
            "preset": build.config.preset,
            "method": "sd",
            "target": target_key,
            "layers": sd.layers,
        }
        result = train_and_save(
            build, model, items, sd.train_config(build.config.train), folder, stage, False, info, sd.lora(), sd.layers
        )
        return f"{result.seconds / 60:.1f} min on {len(items)} of {answers} own answers"

    return Stage("sd", build.run_dir / "sd", "sd", sd_inputs(build.config, target_key), CHECKPOINT, run).output()


def export_draft(build: Build, sd_dir: Path, ss_dir: Path, export: ExportConfig, longest: int) -> Path:
    """The draft model exported like the target, to its own small artifact (<run>/sd-export): the same engines,
    fp32, a cache `longest` drafts past the target's, its head pruned to the sd.vocab tokens most frequent in the
    SS model's own answers and their prompts (answers copy names from them); parity checked like SS's."""
    out = build.run_dir / "sd-export"
    sd = build.config.section("sd")
    items, _ = build.target_answers(build.inference_model(ss_dir), model_key(ss_dir), sd.unlabelled)
    head = build.vocab("draft head", [item.input_ids for item in items], sd.vocab)
    config = dataclasses.replace(
        export,
        trees=("gamma=1,k=1",),
        buckets=(2,),
        capacity=export.capacity + longest,
        quantize="none",
        draft_vocab=0,
        greedy_schedule="auto",
        parity_prompts=min(export.parity_prompts, 5),
    )
    print(f"[sd] exporting the draft model ({', '.join(b for b in config.backends if b != 'torch')})", flush=True)
    ArtifactBuilder(
        sd_dir,
        out,
        config,
        build.parity_prompts(),
        build.config.eval.max_new_tokens,
        {"drafter": "sd"},
        None,
        [ex.id for ex in build.test],
        head=head,
    ).build()
    return out


def install(build: Build, artifact: Path, ss_dir: Path, sd_dir: Path, export: ExportConfig) -> None:
    """The exported draft model (its cache long enough for every chain a method verifies with it) as drafters/sd."""
    sd = build.config.section("sd")
    draft = export_draft(build, sd_dir, ss_dir, export, longest_chain(build.config))
    install_drafter(
        artifact,
        "sd",
        draft,
        {
            "tree": TreeSpec.chain(sd.gamma).to_dict(),
            "layers": sd.layers,
            "training_key": read_manifest(sd_dir)["info"]["training_key"],
        },
    )
    print(f"[sd] draft model added to {artifact}/drafters/sd", flush=True)


BUILD = MethodBuild("sd", DraftModelConfig, train, install, chain=lambda sd: sd.gamma)
