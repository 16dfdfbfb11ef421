"""The build's trained stages (training/stage.py), in the order run_build makes them: the SS model and
the next-token LoRA baseline, the self-distilled second stage, and the other methods' drafters (each method's
build part, methods/<name>/build.py, with what they share here). Each function returns the stage's folder,
reused or made; `*_inputs` say what each one's key is a hash of."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamfuse.adapters.checkpoint import MANIFEST as CHECKPOINT_MANIFEST
from streamfuse.adapters.checkpoint import load_checkpoint, read_manifest, save_checkpoint, update_info, weights_digest
from streamfuse.methods import ss
from streamfuse.training import report
from streamfuse.training.build_part import enabled
from streamfuse.training.data import prompt_format
from streamfuse.training.distill import distill_rows
from streamfuse.training.stage import OutputFormat, Stage, recipe
from streamfuse.training.tasks.base import UNLABELLED
from streamfuse.training.train import TrainResult, train

if TYPE_CHECKING:
    from streamfuse.training.build_state import BuildState as Build
    from streamfuse.training.config import BuildConfig, TrainConfig

CHECKPOINT = OutputFormat(CHECKPOINT_MANIFEST, read_manifest)
# The SS model's folder under the run, its stage's key suffix and its report label (the target every method's
# drafter reads): the ss method's name.
SS_MODEL = ss.NAME

# TrainConfig fields that only the streams use: the next-token baseline's key leaves them out.
STREAM_TRAIN_FIELDS = ("stream_weight", "pruning_weight", "stream_lr_scale", "init_lr_scale")


def model_key(directory: Path) -> str:
    """What results computed from a checkpoint are cached under: its settings and its weights."""
    return f"{read_manifest(directory)['info']['training_key']}-{weights_digest(directory)}"


# --- first stage ------------------------------------------------------------------------------
def train_inputs(config: BuildConfig, task: str, base_model: str, with_streams: bool) -> dict:
    """Everything that determines the trained weights. The next-token baseline ignores the stream
    settings; the test cut and, unless its rest trains, the validation cut do not change what trains."""
    data, train_fields = asdict(config.data), asdict(config.train)
    data.pop("test_limit")
    if not config.data.train_on_validation_rest:
        data.pop("validation_limit")
    inputs = {"task": task, "base": base_model, "lora": asdict(config.lora), "data": data, "train": train_fields}
    if with_streams:
        inputs["streams"] = asdict(config.streams)
    else:
        for name in STREAM_TRAIN_FIELDS:
            train_fields.pop(name)
    return inputs


def trained(build: Build, name: str, with_streams: bool) -> Path:
    """<run>/<name>: the SS model (with_streams) or the next-token LoRA baseline, on the task's data."""
    prompt = prompt_format(build.task, build.config.data.max_source_tokens).to_dict()

    def run(folder: Path, stage: Stage) -> str:
        model = build.new_model()
        info = {
            "task": build.task.name,
            "prompt": prompt,
            "preset": build.config.preset,
            "with_streams": with_streams,
            "extra_parameters": model.extra_parameters(),
        }
        result = train_and_save(build, model, build.train_items, build.config.train, folder, stage, with_streams, info)
        return f"{name}: {result.seconds / 60:.1f} min, {result.tokens} tokens"

    inputs = train_inputs(build.config, build.task.name, build.args.base_model, with_streams)
    kind = SS_MODEL if with_streams else "lora"
    directory = Stage("train", build.run_dir / name, kind, inputs, CHECKPOINT, run).output()
    if CHECKPOINT.info(directory).get("prompt") != prompt:
        update_info(directory, prompt=prompt)  # checkpoints that record no prompt
    return directory


def train_and_save(
    build: Build,
    model,
    items,
    config: TrainConfig,
    folder: Path,
    stage: Stage,
    with_streams: bool,
    info: dict,
    lora=None,
    base_layers: int | None = None,
) -> TrainResult:
    """Train (resumably, from stage.scratch), then save the checkpoint to `folder` with `info` plus this
    stage's figures. A model of the base's first `base_layers` layers (a draft model) has no frozen bottom
    shared with the others."""
    states = build.frozen_states if base_layers is None else None
    result = train(model, items, config, stage.scratch, build.pad_id, with_streams, stage.directory.name, states)
    figures = {
        "train_seconds": round(result.seconds, 1),
        "train_tokens": result.tokens,
        "optimizer_steps": result.optimizer_steps,
        "final_losses": result.final_losses,
    }
    save_checkpoint(
        model,
        build.tokenizer,
        folder,
        build.args.base_model,
        lora or build.config.lora,
        {**info, **figures, "training_key": stage.key, "config": build.config.as_dict()},
        base_layers,
    )
    return result


# --- second stage -----------------------------------------------------------------------------
def distill_inputs(config: BuildConfig, first_key: str) -> dict:
    """The distilled model depends on the first stage, the answers' length and the stage's recipe."""
    return {"first": first_key, "distill": asdict(config.distill), "answer_tokens": config.data.max_target_tokens}


def distilled(build: Build, first_dir: Path) -> Path:
    """<run>/ss: the first-stage SS model trained further on its own greedy answers. Keyed on the first
    stage's key; made again when the first stage's weights change under it (a retrain, a copied-in one)."""
    distill, first = build.config.distill, read_manifest(first_dir)["info"]
    first_weights = weights_digest(first_dir)

    def run(folder: Path, stage: Stage) -> str:
        first_model, first_key = build.inference_model(first_dir), model_key(first_dir)
        answers = build.own_answers(first_model, first_key, build.train_examples, "train")
        if distill.unlabelled:  # inputs without references: their own answers are their only targets
            answers += build.own_answers(
                first_model, first_key, build.task.load(UNLABELLED, build.args.data_dir), UNLABELLED
            )
        del first_model
        # Frozen: LoRA loads untrainable, so the main stream computes exactly what the first stage's does.
        model, _, _ = load_checkpoint(first_dir, build.args.base_model, trainable=distill.main_targets != "frozen")
        if distill.init_rank:
            torch.manual_seed(build.config.train.seed)  # the new f_eta blocks: the same every build
            try:
                model.grow_stream_init(distill.init_rank, distill.init_per_stream)
            except ValueError as error:
                raise ValueError(
                    f"{first_dir}: {error}; pass --set distill.init_rank=0 to train its streams as they are"
                ) from error
        items, finished = distill_rows(
            answers,
            build.train_items,
            build.tokenizer.eos_token_id,
            distill.main_targets,
            build.config.data.max_target_tokens,
            distill.with_references,
        )
        first_stage = {
            "training_key": first["training_key"],
            "weights": first_weights,
            **{k: first[k] for k in report.STAGE_FIELDS},
        }
        info = {**first, "extra_parameters": model.extra_parameters(), "first_stage": first_stage}
        config = distill.train_config(build.config.train)
        result = train_and_save(build, model, items, config, folder, stage, True, info)
        return (
            f"{result.seconds / 60:.1f} min on {finished} of {len(answers)} own answers (the rest did not "
            f"finish) and {len(items) - finished} references"
        )

    return Stage(
        "distil",
        build.run_dir / SS_MODEL,
        "distilled",
        distill_inputs(build.config, first["training_key"]),
        CHECKPOINT,
        run,
        made_from={"first_stage": first_weights},
    ).output()


# --- other methods' drafters (methods/<name>/build.py) ----------------------------------------
def target_features(build: Build, ss_dir: Path, target_key: str, unlabelled: bool, name: str, features: Callable):
    """features(target, items, cache) of the SS model (packed for inference) over its own answers, cached at
    <run>/distill/<target_key>-<name>[-unlabelled].safetensors -> (features, items, answers it gave)."""
    target = build.inference_model(ss_dir)
    items, answers = build.target_answers(target, target_key, unlabelled)
    cache = build.run_dir / "distill" / f"{target_key}-{name}{'-unlabelled' if unlabelled else ''}.safetensors"
    return features(target, items, cache), items, answers


def target_stage_inputs(config: BuildConfig, section: str, target_key: str, *runtime_choices: str) -> dict:
    """What a drafter trained on the SS model's states over its own answers depends on: that target, the seed, the
    answers' length and the section's recipe (without `runtime_choices`: recipe)."""
    return {
        "target": target_key,
        section: recipe(config.section(section), *runtime_choices),
        "seed": config.train.seed,
        "answer_tokens": config.data.max_target_tokens,
    }


def target_stage(
    build: Build,
    ss_dir: Path,
    label: str,
    section: str,
    output: OutputFormat,
    name: str,
    features: Callable,
    fit: Callable[..., str],
    *runtime_choices: str,
) -> Path:
    """<run>/<label>: a drafter trained on the frozen SS model's features over its own answers (target_features
    `name` and `features`; the unlabelled inputs' too where the section says so), keyed on target_stage_inputs.
    fit(folder, stage, target key, features, items, answers it gave) writes it and returns the log's line."""
    config, target_key = build.config.section(section), model_key(ss_dir)

    def run(folder: Path, stage: Stage) -> str:
        data = target_features(build, ss_dir, target_key, config.unlabelled, name, features)
        return fit(folder, stage, target_key, *data)

    inputs = target_stage_inputs(build.config, section, target_key, *runtime_choices)
    return Stage(label, build.run_dir / label, section, inputs, output, run).output()


def method_stages(build: Build, ss_dir: Path) -> dict[str, Path]:
    """Each enabled build part's trained folder, by config section (a part after those it reads)."""
    trained: dict[str, Path] = {}
    for part in enabled(build.config):
        trained[part.section] = part.train(build, ss_dir, {need: trained[need] for need in part.needs})
    return trained
