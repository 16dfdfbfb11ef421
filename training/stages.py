"""The build's trained stages (training/stage.py), in the order run_build makes them: the SS model and
the next-token LoRA baseline, the self-distilled second stage, and the other methods' drafters: sd's
draft model, Medusa's heads, the ParallelSpec and Falcon drafters, and the acceptance heads of specdec++
and ss-adaptive. Each function returns the stage's folder, reused or made; `*_inputs` say what each
one's key is a hash of."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamfuse.adapters import falcon as falcon_files
from streamfuse.adapters.acceptance import MANIFEST as ACCEPTANCE_MANIFEST
from streamfuse.adapters.acceptance import AcceptanceHead, read_acceptance_manifest, save_acceptance_head
from streamfuse.adapters.base_model import load_base_model
from streamfuse.adapters.checkpoint import MANIFEST as CHECKPOINT_MANIFEST
from streamfuse.adapters.checkpoint import load_checkpoint, read_manifest, save_checkpoint, update_info, weights_digest
from streamfuse.adapters.draft_model import draft_model as first_layers_model
from streamfuse.adapters.medusa import MANIFEST as MEDUSA_MANIFEST
from streamfuse.adapters.medusa import MedusaHeads, read_heads_manifest, save_heads
from streamfuse.adapters.parallelspec import MANIFEST as PARALLEL_MANIFEST
from streamfuse.adapters.parallelspec import ParallelSpecModel, read_drafter_manifest, save_drafter
from streamfuse.training import report
from streamfuse.training.acceptance import AcceptanceFeatures, AcceptanceTraining, acceptance_features, train_acceptance
from streamfuse.training.config import BuildConfig, TrainConfig
from streamfuse.training.data import prompt_format
from streamfuse.training.distill import distill_rows
from streamfuse.training.falcon import FalconTraining, train_falcon
from streamfuse.training.medusa import HeadTraining, head_features, train_heads
from streamfuse.training.parallelspec import DrafterTraining, answer_states, embed_scale, train_drafter
from streamfuse.training.stage import OutputFormat, Stage, recipe
from streamfuse.training.stream_acceptance import stream_acceptance_features
from streamfuse.training.tasks.base import UNLABELLED
from streamfuse.training.train import TrainResult, train

if TYPE_CHECKING:
    from streamfuse.training.pipeline import Build

CHECKPOINT = OutputFormat(CHECKPOINT_MANIFEST, read_manifest)
MEDUSA_HEADS = OutputFormat(MEDUSA_MANIFEST, read_heads_manifest)
PARALLEL_DRAFTER = OutputFormat(PARALLEL_MANIFEST, read_drafter_manifest)
FALCON_DRAFTER = OutputFormat(falcon_files.MANIFEST, falcon_files.read_drafter_manifest)
ACCEPTANCE_HEAD = OutputFormat(ACCEPTANCE_MANIFEST, read_acceptance_manifest)

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
        info = {"task": build.task.name, "prompt": prompt, "preset": build.config.preset, "with_streams": with_streams,
                "extra_parameters": model.extra_parameters()}
        result = train_and_save(build, model, build.train_items, build.config.train, folder, stage, with_streams, info)
        return f"{name}: {result.seconds / 60:.1f} min, {result.tokens} tokens"

    inputs = train_inputs(build.config, build.task.name, build.args.base_model, with_streams)
    directory = Stage("train", build.run_dir / name, "ss" if with_streams else "lora", inputs, CHECKPOINT, run).output()
    if CHECKPOINT.info(directory).get("prompt") != prompt:
        update_info(directory, prompt=prompt)  # checkpoints from before the prompt was recorded
    return directory


def train_and_save(build: Build, model, items, config: TrainConfig, folder: Path, stage: Stage, with_streams: bool,
                   info: dict, lora=None, base_layers: int | None = None) -> TrainResult:
    """Train (resumably, from stage.scratch), then save the checkpoint to `folder` with `info` plus this
    stage's figures. A model of the base's first `base_layers` layers (a draft model) has no frozen bottom
    shared with the others."""
    states = build.frozen_states if base_layers is None else None
    result = train(model, items, config, stage.scratch, build.pad_id, with_streams, stage.directory.name, states)
    figures = {"train_seconds": round(result.seconds, 1), "train_tokens": result.tokens,
               "optimizer_steps": result.optimizer_steps, "final_losses": result.final_losses}
    save_checkpoint(model, build.tokenizer, folder, build.args.base_model, lora or build.config.lora,
                    {**info, **figures, "training_key": stage.key, "config": build.config.as_dict()}, base_layers)
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
            answers += build.own_answers(first_model, first_key, build.task.load(UNLABELLED, build.args.data_dir),
                                         UNLABELLED)
        del first_model
        # Frozen: LoRA loads untrainable, so the main stream computes exactly what the first stage's does.
        model, _, _ = load_checkpoint(first_dir, build.args.base_model, trainable=distill.main_targets != "frozen")
        if distill.init_rank:
            torch.manual_seed(build.config.train.seed)  # the new f_eta blocks: the same every build
            try:
                model.grow_stream_init(distill.init_rank, distill.init_per_stream)
            except ValueError as error:
                raise ValueError(f"{first_dir}: {error}; pass --set distill.init_rank=0 to train its streams as they "
                                 f"are") from error
        items, finished = distill_rows(answers, build.train_items, build.tokenizer.eos_token_id, distill.main_targets,
                                       build.config.data.max_target_tokens, distill.with_references)
        first_stage = {"training_key": first["training_key"], "weights": first_weights,
                       **{k: first[k] for k in report.STAGE_FIELDS}}
        info = {**first, "extra_parameters": model.extra_parameters(), "first_stage": first_stage}
        config = distill.train_config(build.config.train)
        result = train_and_save(build, model, items, config, folder, stage, True, info)
        return (f"{result.seconds / 60:.1f} min on {finished} of {len(answers)} own answers (the rest did not "
                f"finish) and {len(items) - finished} references")

    return Stage("distil", build.run_dir / "ss", "distilled", distill_inputs(build.config, first["training_key"]),
                 CHECKPOINT, run, made_from={"first_stage": first_weights}).output()


# --- other methods' drafters ------------------------------------------------------------------
def sd_inputs(config: BuildConfig, target_key: str) -> dict:
    """The draft model depends on the target whose answers it learns, their length and its recipe (not
    gamma: how many it drafts per step is the runtime's choice; not vocab: the export prunes its head)."""
    return {"target": target_key, "sd": recipe(config.sd, "gamma", "vocab"), "train": asdict(config.train),
            "answer_tokens": config.data.max_target_tokens}


def draft_model(build: Build, ss_dir: Path) -> Path:
    """<run>/sd, method sd: the base's first layers with LoRA, trained on the SS model's own greedy answers."""
    sd, target_key = build.config.sd, model_key(ss_dir)

    def run(folder: Path, stage: Stage) -> str:
        items, answers = build.target_answers(build.inference_model(ss_dir), target_key, sd.unlabelled)
        base, _ = load_base_model(build.args.base_model)
        torch.manual_seed(build.config.train.seed)
        model = first_layers_model(base, sd.layers, sd.lora())
        info = {"task": build.task.name, "preset": build.config.preset, "method": "sd", "target": target_key,
                "layers": sd.layers}
        result = train_and_save(build, model, items, sd.train_config(build.config.train), folder, stage, False, info,
                                sd.lora(), sd.layers)
        return f"{result.seconds / 60:.1f} min on {len(items)} of {answers} own answers"

    return Stage("sd", build.run_dir / "sd", "sd", sd_inputs(build.config, target_key), CHECKPOINT, run).output()


def target_features(build: Build, ss_dir: Path, target_key: str, unlabelled: bool, name: str, features: Callable):
    """features(target, items, cache) of the SS model (packed for inference) over its own answers, cached at
    <run>/distill/<target_key>-<name>[-unlabelled].safetensors -> (features, items, answers it gave)."""
    target = build.inference_model(ss_dir)
    items, answers = build.target_answers(target, target_key, unlabelled)
    cache = build.run_dir / "distill" / f"{target_key}-{name}{'-unlabelled' if unlabelled else ''}.safetensors"
    return features(target, items, cache), items, answers


def medusa_inputs(config: BuildConfig, target_key: str) -> dict:
    """The heads depend on the target whose states they read, its answers' length and their recipe."""
    return {"target": target_key, "medusa": recipe(config.medusa), "seed": config.train.seed,
            "answer_tokens": config.data.max_target_tokens}


def medusa_heads(build: Build, ss_dir: Path) -> Path:
    """<run>/medusa, method medusa: heads on the frozen SS model's states over its own answers (Medusa-1)."""
    config, target_key = build.config.medusa, model_key(ss_dir)

    def run(folder: Path, stage: Stage) -> str:
        features, items, answers = target_features(
            build, ss_dir, target_key, config.unlabelled, f"medusa{config.heads}",
            lambda target, items, cache: head_features(target, items, config.heads, cache))
        torch.manual_seed(build.config.train.seed)
        heads = MedusaHeads(config.heads, features.hidden.shape[1])
        training = HeadTraining(config.epochs, config.learning_rate, config.batch, seed=build.config.train.seed)
        # The features' target was packed: its kernels pass no gradient, so train through the eager head.
        eager, _, _ = load_checkpoint(ss_dir, build.args.base_model, merge_lora=True)
        result = train_heads(heads, eager.parts.lm_head, features, training)
        save_heads(heads, folder, {"training_key": stage.key, "target": target_key, "answers": len(items), **result})
        return (f"{result['seconds'] / 60:.1f} min on {len(features.hidden)} positions of {len(items)} of "
                f"{answers} own answers")

    return Stage("medusa", build.run_dir / "medusa", "medusa", medusa_inputs(build.config, target_key), MEDUSA_HEADS,
                 run).output()


def parallelspec_inputs(config: BuildConfig, target_key: str) -> dict:
    """The drafter depends on the target whose states it reads, its answers' length and its recipe (not the
    exported cache's capacity, its format or its tree)."""
    return {"target": target_key, "parallelspec": recipe(config.parallelspec, "capacity", "tree", "quantize"), "seed": config.train.seed,
            "answer_tokens": config.data.max_target_tokens}


def parallel_drafter(build: Build, ss_dir: Path) -> Path:
    """<run>/parallelspec, method parallelspec: a one-layer drafter on the frozen SS model's states over its own
    answers, its head pruned to the parallelspec.vocab tokens most frequent in them and their prompts."""
    config, target_key = build.config.parallelspec, model_key(ss_dir)
    training = DrafterTraining(config.epochs, config.learning_rate, config.items, config.decay, build.config.train.seed)
    run = fused_drafter_run(build, ss_dir, target_key, "parallelspec", config,
                            lambda model, ids: ParallelSpecModel.like(model, ids, config.masks),
                            lambda *data: train_drafter(*data, training), save_drafter)
    return Stage("parallelspec", build.run_dir / "parallelspec", "parallelspec",
                 parallelspec_inputs(build.config, target_key), PARALLEL_DRAFTER, run).output()


def fused_drafter_run(build: Build, ss_dir: Path, target_key: str, label: str, config, make: Callable,
                      train: Callable, save: Callable) -> Callable[[Path, Stage], str]:
    """The stage run of a fused drafter (adapters/fused_drafter.py): make(model, kept ids) it, its layer a copy of
    the SS model's last and its fused input scaled to the target's states; train(drafter, embed, items, states)
    on the SS model's own answers (config.unlabelled: the unlabelled inputs' too); save(drafter, folder, info)."""
    def run(folder: Path, stage: Stage) -> str:
        states, items, answers = target_features(build, ss_dir, target_key, config.unlabelled, "answer-states",
                                                 answer_states)
        vocab = build.vocab(f"{label} head", [item.input_ids for item in items], config.vocab)
        eager, _, _ = load_checkpoint(ss_dir, build.args.base_model, merge_lora=True)
        ids = torch.tensor(vocab.ids) if vocab is not None else torch.arange(eager.parts.vocab_size)
        torch.manual_seed(build.config.train.seed)
        drafter = make(eager.model, ids)
        drafter.start_fused(embed_scale(states, eager.parts.embed))
        result = train(drafter, eager.parts.embed, items, states)
        coverage = None if vocab is None else round(vocab.coverage, 4)
        save(drafter, folder, {"training_key": stage.key, "target": target_key, "answers": len(items),
                               "vocab_coverage": coverage, **result})
        return f"{result['seconds'] / 60:.1f} min on {len(states.hidden)} positions of {len(items)} of {answers} own answers"
    return run


def falcon_inputs(config: BuildConfig, target_key: str) -> dict:
    """The drafter depends on the target whose states it reads, its answers' length and its recipe (not the
    exported cache, its scratch, its format or its tree)."""
    return {"target": target_key, "falcon": recipe(config.falcon, "capacity", "max_passes", "tree", "quantize"),
            "seed": config.train.seed, "answer_tokens": config.data.max_target_tokens}


def falcon_drafter(build: Build, ss_dir: Path) -> Path:
    """<run>/falcon, method falcon: a one-layer semi-autoregressive drafter on the frozen SS model's states over
    its own answers (CSGD), its head pruned to the falcon.vocab tokens most frequent in them and their prompts."""
    config, target_key = build.config.falcon, model_key(ss_dir)
    training = FalconTraining(config.epochs, config.learning_rate, config.items, config.passes, config.glance,
                              distill_weight=config.distill_weight, seed=build.config.train.seed)
    run = fused_drafter_run(build, ss_dir, target_key, "falcon", config,
                            lambda model, ids: falcon_files.FalconModel.like(model, ids, config.block),
                            lambda *data: train_falcon(*data, training), falcon_files.save_drafter)
    return Stage("falcon", build.run_dir / "falcon", "falcon", falcon_inputs(build.config, target_key),
                 FALCON_DRAFTER, run).output()


def specdec_inputs(config: BuildConfig, draft_key: str) -> dict:
    """The head depends on the draft model it reads and its recipe (not the threshold or γ_max: runtime choices)."""
    return {"draft": draft_key, "specdec": recipe(config.specdec, "threshold", "max_drafts"), "seed": config.train.seed}


def specdec_head(build: Build, ss_dir: Path, sd_dir: Path) -> Path:
    """<run>/specdec, method specdec++: an acceptance head on sd's frozen draft model, over the SS model's own
    answers."""
    draft_key = read_manifest(sd_dir)["info"]["training_key"]

    def run(folder: Path, stage: Stage) -> str:
        items, answers = build.target_answers(build.inference_model(ss_dir), model_key(ss_dir),
                                              build.config.sd.unlabelled)
        draft, _, _ = load_checkpoint(sd_dir, build.args.base_model, merge_lora=True)
        cache = build.run_dir / "distill" / f"{draft_key}-acceptance.safetensors"
        features = acceptance_features(draft.eval(), items, cache)
        info = {"training_key": stage.key, "draft": draft_key, "answers": len(items)}
        return acceptance_head(build, "specdec++", features, build.config.specdec, folder, info, answers)

    return Stage("specdec++", build.run_dir / "specdec", "specdec", specdec_inputs(build.config, draft_key),
                 ACCEPTANCE_HEAD, run).output()


def adaptive_inputs(config: BuildConfig, target_key: str) -> dict:
    """The head depends on the SS model whose streams it reads, its answers' length and its recipe."""
    return {"target": target_key, "adaptive": recipe(config.adaptive), "seed": config.train.seed,
            "answer_tokens": config.data.max_target_tokens}


def adaptive_head(build: Build, ss_dir: Path) -> Path:
    """<run>/ss-adaptive, method ss-adaptive: an acceptance head on the frozen SS model's stream states, over
    its own answers."""
    config, target_key = build.config.adaptive, model_key(ss_dir)

    def run(folder: Path, stage: Stage) -> str:
        features, items, answers = target_features(
            build, ss_dir, target_key, config.unlabelled, "stream-acceptance",
            lambda target, items, cache: stream_acceptance_features(target, items, build.pad_id, cache))
        info = {"training_key": stage.key, "target": target_key, "answers": len(items)}
        return acceptance_head(build, "ss-adaptive", features, config, folder, info, answers)

    return Stage("ss-adaptive", build.run_dir / "ss-adaptive", "adaptive", adaptive_inputs(build.config, target_key),
                 ACCEPTANCE_HEAD, run).output()


def acceptance_head(build: Build, method: str, features: AcceptanceFeatures, config, folder: Path, info: dict,
                    answers: int) -> str:
    """Train and save an acceptance head (specdec++'s or ss-adaptive's) on its features."""
    torch.manual_seed(build.config.train.seed)
    head = AcceptanceHead(features.hidden.shape[1], config.depth)
    training = AcceptanceTraining(config.epochs, config.learning_rate, config.batch, config.reject_weight,
                                  build.config.train.seed)
    result = train_acceptance(head, features, training, desc=f"train {method}")
    save_acceptance_head(head, folder, {**info, **result})
    return (f"{result['seconds'] / 60:.1f} min on {result['examples']} drafts of {info['answers']} of {answers} own "
            f"answers (accepted {result['acceptance_rate']:.0%}; mean prediction {result['predicted_if_accepted']} "
            f"where accepted, {result['predicted_if_rejected']} where not)")
