"""python export/build.py --task dialogsum: fine-tune, evaluate, export and profile a Speculative
Streaming model.

Stages (each one reuses its output when rerun with the same settings):
  data      load the task's splits and tokenize them in the chat format
  train     the SS model (LoRA + streams + pruning head, eq. 5) and the next-token-only LoRA
            baseline; resumable snapshots every few steps
  distil    (--distill) the SS model's own greedy answers to the training inputs, then a second stage on
            them, so streams learn what decoding will accept (export/distill.py)
  evaluate  zero-shot base, LoRA baseline and SS model on the test split (greedy), stream
            accuracy on validation against the references, and on the test split against the SS
            model's own greedy answers (the ones its ROUGE is scored on); eval.json goes into the SS checkpoint
  calibrate the acceptance model (own answers to validation inputs, teacher-forced stream ranks) and
            the step cost of the best tree of each size on this machine: which trees the graphs get
  export    static-shape graphs (fixed tree masks, static KV cache) for ExecuTorch (.pte, XNNPACK),
            ONNX and Core ML (.mlpackage), LoRA merged, into one self-describing artifact folder;
            then each backend that runs here times the artifact's trees and records its choice
  verify    each backend that runs here against torch eager: greedy tokens and step outputs
  profile   SS vs plain decoding on test inputs with the artifact: speed-up, CR, time split
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from streamfuse.adapters.base_model import DEFAULT_BASE_MODEL, load_base_model
from streamfuse.adapters.checkpoint import load_checkpoint, read_manifest, save_checkpoint, update_info, weights_digest
from streamfuse.adapters.config import StreamConfig
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export import report
from streamfuse.export.artifact import (
    DEFAULT_BACKENDS, RUNS_HERE, ArtifactBuilder, ExportConfig,
)
from streamfuse.export.calibration import acceptance_model, tree_text, trees_to_export
from streamfuse.export.draft_vocab import DraftVocab, draft_vocab
from streamfuse.export.config import MAIN_TARGETS, PRESETS, BuildConfig, preset
from streamfuse.export.data import Encoded, encode, prompt_format, prompt_text
from streamfuse.export.distill import distill_rows, self_distilled
from streamfuse.export.evaluation import (answer_quality, greedy_answer_ids, packed_for_inference,
                                          stream_accuracy, task_quality)
from streamfuse.export.frozen_states import FrozenStates
from streamfuse.export.tasks import TASKS, get_task
from streamfuse.export.tasks.base import UNLABELLED
from streamfuse.export.profiling import profile_artifact
from streamfuse.export.train import train
from streamfuse.export.lock import exclusive
from streamfuse.export.verify import ParityError
from streamfuse.runtime import cli
from streamfuse.runtime.artifact import Artifact
from streamfuse.runtime.calibration import AcceptanceModel, BackendCalibration
from streamfuse.runtime.loader import fastest_backend
from streamfuse.tools.calibrate import calibrate_sources


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="dialogsum", choices=sorted(TASKS), help="task to fine-tune on")
    parser.add_argument("--base-model", default=DEFAULT_BASE_MODEL,
                        help=f"'{DEFAULT_BASE_MODEL}' (bundled GGUF, converted once), a local HF folder, or a hub id")
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                        help="smoke: minutes, tests the pipeline; cpu (default): about an hour on 2 cores; "
                             "cpu-distill: the benchmarked model, ~2.5 h on 2 cores; paper: the paper's recipe, GPU")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder with the task's files (default: ../shared/data/<task> beside the repo, else the hub)")
    parser.add_argument("--work-dir", type=Path, default=Path("checkpoints"),
                        help="where checkpoints, snapshots and eval results go (default: checkpoints/); a run with "
                             "changed settings replaces <work-dir>/<task>-<preset>/ss, so give experiments their own")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--train-limit", type=int, default=None, help="use only the first N training examples")
    parser.add_argument("--test-limit", type=int, default=None, help="evaluate on the first N test examples")
    parser.add_argument("--train-on-validation-rest", action=argparse.BooleanOptionalAction, default=None,
                        help="train on the validation split's rows past the held-out slice too (default: the "
                             "preset's choice; cpu does)")
    parser.add_argument("--epochs", type=float, default=None, help="override the preset's epochs")
    parser.add_argument("--gamma", type=int, default=None, help="override the preset's number of streams")
    parser.add_argument("--msa-layers", type=int, default=None, help="override the preset's N_s (multi-stream layers)")
    parser.add_argument("--stream-weight", type=float, default=None, help="override alpha_j, the streams' loss weight")
    parser.add_argument("--init-rank", type=int, default=None,
                        help="override the rank of each stream's own f_eta block in the first stage (0: identity)")
    parser.add_argument("--init-lr-scale", type=float, default=None,
                        help="override the first stage's learning-rate multiplier for the f_eta blocks")
    parser.add_argument("--distill", action=argparse.BooleanOptionalAction, default=None,
                        help="add (or skip) the self-distillation stage; default: the preset's choice")
    parser.add_argument("--distill-stream-weight", type=float, default=None,
                        help="override alpha_j of the self-distillation stage")
    parser.add_argument("--distill-main-targets", choices=MAIN_TARGETS, default=None,
                        help="what the main stream trains on in the self-distillation stage: its own answers, the "
                             "references, or nothing (frozen: only the streams train; default: the preset's)")
    parser.add_argument("--distill-init-rank", type=int, default=None,
                        help="give the streams a per-stream f_eta of this rank at the self-distillation stage")
    parser.add_argument("--distill-with-references", action=argparse.BooleanOptionalAction, default=None,
                        help="with --distill-main-targets frozen: the streams train on the reference answers as well "
                             "as the model's own")
    parser.add_argument("--distill-unlabelled", action=argparse.BooleanOptionalAction, default=None,
                        help="the self-distillation stage also trains on the task's unlabelled inputs (their targets: "
                             "the model's own answers; DialogSum: 1,398 dialogues; default: the preset's, cpu-distill on)")
    parser.add_argument("--distill-epochs", type=float, default=None,
                        help="override the self-distillation stage's epochs")
    parser.add_argument("--distill-lr", type=float, default=None,
                        help="override the self-distillation stage's learning rate")
    parser.add_argument("--skip-baseline", action="store_true", help="do not train/evaluate the LoRA baseline")
    parser.add_argument("--skip-zero-shot", action="store_true", help="do not evaluate the untuned base model")
    parser.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                        help="comma-separated export targets among torch, executorch (XNNPACK), onnx, coreml "
                             "(.mlpackage), executorch_coreml (.pte with the Core ML delegate); 'torch' skips export")
    parser.add_argument("--tree", default=None, help="the draft trees with step graphs, ';'-separated, the default "
                        "first: each 'gamma=G,k=K', a JSON list of paths or a JSON file (default: calibrated, the "
                        "tree that pays most on this machine and the best of up to 8 nodes, plus the 2-node tree "
                        "when quantized)")
    parser.add_argument("--calibration-inputs", type=int, default=4,
                        help="validation inputs each backend's calibration times (step cost per tree)")
    parser.add_argument("--quantize", default="none",
                        help="weights: none; q4-native (the base GGUF's own 4-bit codes, LoRA in fp32: exact on "
                             "ONNX, bf16 scales on ExecuTorch); int8 (ExecuTorch, ONNX); 8da4w (ExecuTorch). Backends "
                             "without the format export fp32")
    parser.add_argument("--context", type=int, default=ExportConfig.capacity,
                        help="KV capacity of the exported graphs (positions)")
    parser.add_argument("--prefill-chunk", type=int, default=ExportConfig.prefill_chunk,
                        help="prompt tokens per exported prefill call")
    parser.add_argument("--draft-vocab", type=int, default=ExportConfig.draft_vocab,
                        help="tokens greedy_step's streams rank: the task's most frequent ones (0: all)")
    parser.add_argument("--greedy-schedule", default=ExportConfig.greedy_schedule,
                        choices=("auto", "fused", "deferred"),
                        help="greedy_step's streams: beside every tree node (fused), for the accepted node after "
                             "verifying (deferred), or by tree size (auto: fused up to 7 nodes)")
    parser.add_argument("--export-workers", type=int, default=2,
                        help="export processes: 2 lowers ExecuTorch while a second process exports ONNX and Core ML "
                             "(mostly single-threaded work; ~5 min less on 2 cores, one more model in memory)")
    parser.add_argument("--parity-prompts", type=int, default=ExportConfig.parity_prompts,
                        help="test inputs for the backend parity check")
    parser.add_argument("--profile-limit", type=int, default=20, help="test inputs for the profile stage (0 skips it)")
    parser.add_argument("--out", type=Path, default=None, help="artifact folder (default: artifacts/<task>)")
    cli.add_debug_flag(parser)
    args = parser.parse_args(argv)
    args.out = args.out or Path("artifacts") / args.task
    if args.calibration_inputs < 1:
        parser.error(f"--calibration-inputs must be >= 1 (validation inputs to time), got {args.calibration_inputs}")
    return args


def export_config(args: argparse.Namespace) -> ExportConfig:
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    trees = tuple(t.strip() for t in args.tree.split(";") if t.strip()) if args.tree else ExportConfig.trees
    config = ExportConfig(backends, trees, args.context, args.prefill_chunk, args.quantize,
                          parity_prompts=args.parity_prompts, draft_vocab=args.draft_vocab,
                          greedy_schedule=args.greedy_schedule, workers=args.export_workers)
    config.validate()
    return config


def _override(section, **given):
    """section with the fields the command line gave (None: flag not given)."""
    given = {name: value for name, value in given.items() if value is not None}
    return dataclasses.replace(section, **given) if given else section


def build_config(args: argparse.Namespace) -> BuildConfig:
    config = preset(args.preset)
    with_references = args.distill_with_references
    if with_references is None and args.distill_main_targets not in (None, "frozen"):
        with_references = False  # the preset's choice belongs to its frozen recipe
    distill = _override(config.distill, enabled=args.distill, stream_weight=args.distill_stream_weight,
                        main_targets=args.distill_main_targets, init_rank=args.distill_init_rank,
                        learning_rate=args.distill_lr, epochs=args.distill_epochs,
                        with_references=with_references, unlabelled=args.distill_unlabelled)
    streams = _stream_override(config.streams, args)
    if streams.init_rank and args.distill_init_rank is None:  # the first stage has f_eta: train it on, grow none
        distill = dataclasses.replace(distill, init_rank=0)
    distill.validate()
    data = _override(config.data, train_limit=args.train_limit, test_limit=args.test_limit,
                     train_on_validation_rest=args.train_on_validation_rest)
    data.validate()
    return dataclasses.replace(
        config,
        data=data,
        train=_override(config.train, epochs=args.epochs, stream_weight=args.stream_weight,
                        init_lr_scale=args.init_lr_scale),
        streams=streams,
        distill=distill,
    )


def _stream_override(streams: StreamConfig, args: argparse.Namespace) -> StreamConfig:
    streams = _override(streams, num_streams=args.gamma, msa_layers=args.msa_layers)
    if args.init_rank is None:
        return streams
    return dataclasses.replace(streams, init_rank=args.init_rank, init_per_stream=args.init_rank > 0)


def stored_info(directory: Path) -> dict:
    """The info of the checkpoint in `directory`, or {} when there is none yet."""
    return read_manifest(directory)["info"] if (directory / "streamfuse.json").is_file() else {}


def model_key(directory: Path) -> str:
    """What results computed from a checkpoint are cached under: its settings and its weights."""
    return f"{read_manifest(directory)['info']['training_key']}-{weights_digest(directory)}"


class Build:
    def __init__(self, args: argparse.Namespace, config: BuildConfig):
        self.args, self.config = args, config
        self.task = get_task(args.task)
        self.run_dir = args.work_dir / f"{self.task.name}-{config.preset}"
        _, self.tokenizer = load_base_model(args.base_model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.frozen_states = FrozenStates()  # every model of this build sits on the same base model

    # --- data -----------------------------------------------------------------------------
    def load_data(self) -> None:
        data = self.config.data
        validation = self.task.load("validation", self.args.data_dir)
        self.validation = validation[: data.validation_limit]
        extra = validation[data.validation_limit :] if data.train_on_validation_rest else []
        self.train_examples = (self.task.load("train", self.args.data_dir) + extra)[: data.train_limit]
        self.test = self.task.load("test", self.args.data_dir, data.test_limit)
        self.train_items = [self._encode(ex) for ex in self.train_examples]
        self.validation_items = [self._encode(ex) for ex in self.validation]
        self.test_prompts = [prompt_text(self.task, self.tokenizer, ex, data.max_source_tokens) for ex in self.test]
        tokens = sum(len(item.input_ids) for item in self.train_items)
        print(f"[data] {self.task.name}: {len(self.train_items)} train ({tokens} tokens), "
              f"{len(self.validation_items)} validation, {len(self.test)} test", flush=True)

    def _encode(self, example):
        return encode(self.task, self.tokenizer, example, self.config.data.max_source_tokens, self.config.data.max_target_tokens)

    # --- train ----------------------------------------------------------------------------
    def ensure_trained(self, name: str, with_streams: bool) -> Path:
        directory = self.run_dir / name
        key = self.config.training_key(self.task.name, self.args.base_model, with_streams)
        prompt = prompt_format(self.task, self.config.data.max_source_tokens).to_dict()
        existing = stored_info(directory)
        if existing.get("training_key") == key:
            print(f"[train] reusing {directory} (same settings)", flush=True)
            if existing.get("prompt") != prompt:
                update_info(directory, prompt=prompt)  # checkpoints from before the prompt was recorded
            return directory
        model = self.new_model()
        info = {"task": self.task.name, "prompt": prompt, "preset": self.config.preset, "with_streams": with_streams,
                "extra_parameters": model.extra_parameters()}
        result = self._train_and_save(model, self.train_items, self.config.train, directory, key, with_streams, info)
        print(f"[train] {name}: {result.seconds / 60:.1f} min, {result.tokens} tokens -> {directory}", flush=True)
        return directory

    def new_model(self) -> SpeculativeStreamingLM:
        """The base model with fresh LoRA, streams and pruning head, initialised from the training
        seed: libraries reseed torch's generator at import, so without it no two builds match."""
        base, _ = load_base_model(self.args.base_model)
        torch.manual_seed(self.config.train.seed)
        return SpeculativeStreamingLM(add_lora(base, self.config.lora), self.config.streams)

    def _train_and_save(self, model, items, config, directory: Path, key: str, with_streams: bool, info: dict):
        """Train (resumably), then save the checkpoint with `info` plus this stage's figures."""
        snapshot = self.run_dir / f"{directory.name}-{key}.snapshot"
        result = train(model, items, config, snapshot, self.pad_id, with_streams, directory.name, self.frozen_states)
        stage = {"train_seconds": round(result.seconds, 1), "train_tokens": result.tokens,
                 "optimizer_steps": result.optimizer_steps, "final_losses": result.final_losses}
        save_checkpoint(model, self.tokenizer, directory, self.args.base_model, self.config.lora,
                        {**info, **stage, "training_key": key, "config": self.config.as_dict()})
        shutil.rmtree(snapshot, ignore_errors=True)
        return result

    # --- distil ---------------------------------------------------------------------------
    def own_answers(self, model, key: str, examples, split: str) -> list[Encoded]:
        """Prompt + the model's own greedy answer for each example, cached per model and split."""
        prompts = [prompt_text(self.task, self.tokenizer, ex, self.config.data.max_source_tokens) for ex in examples]
        cache = self.run_dir / "distill" / f"{key}-{split}.jsonl"
        return self_distilled(model.model, self.tokenizer, [ex.id for ex in examples], prompts,
                              self.config.data.max_target_tokens, self.config.distill.batch_size, cache, split)

    def ensure_distilled(self, first_dir: Path) -> Path:
        """Second stage: the first-stage SS model trained further on its own greedy answers."""
        directory = self.run_dir / "ss"
        first = read_manifest(first_dir)["info"]
        key = self.config.distill_key(first["training_key"])
        first_weights = weights_digest(first_dir)
        stored = stored_info(directory)
        # Checkpoints from before the first stage's weights were recorded are taken at their key.
        trained_from = stored.get("first_stage", {}).get("weights", first_weights)
        if stored.get("training_key") == key and trained_from == first_weights:
            print(f"[distil] reusing {directory} (same settings)", flush=True)
            return directory
        distill = self.config.distill
        first_model, first_key = self.inference_model(first_dir), model_key(first_dir)
        answers = self.own_answers(first_model, first_key, self.train_examples, "train")
        if distill.unlabelled:  # inputs without references: their own answers are their only targets
            answers += self.own_answers(first_model, first_key, self.task.load(UNLABELLED, self.args.data_dir), UNLABELLED)
        del first_model
        # Frozen: LoRA loads untrainable, so the main stream computes exactly what the first stage's does.
        model, _, _ = load_checkpoint(first_dir, self.args.base_model, trainable=distill.main_targets != "frozen")
        if distill.init_rank:
            torch.manual_seed(self.config.train.seed)  # the new f_eta blocks: the same every build
            try:
                model.grow_stream_init(distill.init_rank, distill.init_per_stream)
            except ValueError as error:
                raise ValueError(f"{first_dir}: {error}; pass --distill-init-rank 0 to train its streams as they "
                                 f"are") from error
        items, finished = distill_rows(answers, self.train_items, self.tokenizer.eos_token_id, distill.main_targets,
                                       self.config.data.max_target_tokens, distill.with_references)
        first_stage = {"training_key": first["training_key"], "weights": first_weights,
                       **{k: first[k] for k in report.STAGE_FIELDS}}
        info = {**first, "extra_parameters": model.extra_parameters(), "first_stage": first_stage}
        result = self._train_and_save(model, items, distill.train_config(self.config.train), directory, key, True, info)
        print(f"[distil] {result.seconds / 60:.1f} min on {finished} of {len(answers)} own answers (the rest did not "
              f"finish) and {len(items) - finished} references -> {directory}", flush=True)
        return directory

    # --- evaluate -------------------------------------------------------------------------
    def inference_model(self, directory: Path) -> SpeculativeStreamingLM:
        """A checkpoint as the runtime runs it (LoRA merged), on packed kernels: generation only."""
        model, _, _ = load_checkpoint(directory, self.args.base_model, merge_lora=True)
        return packed_for_inference(model)

    def cached(self, label: str, key: str, compute) -> dict:
        path = self.run_dir / "eval" / f"{label}.json"
        if path.is_file():
            stored = json.loads(path.read_text())
            if stored.get("key") == key:
                print(f"[eval] reusing {path}", flush=True)
                return stored["result"]
        result = compute()
        report.write_json(path, {"key": key, "result": result})
        return result

    def eval_key(self, checkpoint_key: str) -> str:
        return json.dumps([EVAL_FORMAT, checkpoint_key, dataclasses.asdict(self.config.eval), self.config.data.test_limit,
                           self.config.data.validation_limit, self.config.data.max_source_tokens])

    def quality(self, model, label: str) -> dict:
        ev = self.config.eval
        return task_quality(model, self.tokenizer, self.task, self.test, self.test_prompts, ev.max_new_tokens, ev.batch_size, label)

    def evaluate_checkpoint(self, directory: Path, label: str, with_streams: bool) -> dict:
        key = model_key(directory)

        def compute() -> dict:
            model = self.inference_model(directory)
            if not with_streams:
                return {"test": self.quality(model.model, label)}
            ev = self.config.eval
            answers = greedy_answer_ids(model.model, self.tokenizer, self.test_prompts, ev.max_new_tokens,
                                        ev.batch_size, f"generate {label}")
            # Own answers: the test answers just scored, so no second generation (~1.5 min on 2 cores).
            own = [Encoded(ex.id, ids + answer, len(ids)) for ex, ids, answer in
                   zip(self.test, self.tokenizer(list(self.test_prompts), add_special_tokens=False)["input_ids"], answers)]
            return {"test": answer_quality(self.tokenizer, self.task, self.test, answers),
                    "stream_accuracy": stream_accuracy(model, self.validation_items, self.pad_id, ev.top_k),
                    "stream_accuracy_own": stream_accuracy(model, own, self.pad_id, ev.top_k)}

        return self.cached(label, self.eval_key(key), compute)

    # --- calibrate --------------------------------------------------------------------------
    def acceptance(self, ss_dir: Path) -> AcceptanceModel:
        """The acceptance model: the SS model's own greedy answers to the validation inputs, their
        stream ranks teacher-forced (export/calibration.py); cached with the evaluations."""
        def compute() -> dict:
            model = self.inference_model(ss_dir)
            ev = self.config.eval
            prompts = [prompt_text(self.task, self.tokenizer, ex, self.config.data.max_source_tokens)
                       for ex in self.validation]
            answers = greedy_answer_ids(model.model, self.tokenizer, prompts, ev.max_new_tokens, ev.batch_size,
                                        "generate validation")
            items = [Encoded(ex.id, ids + answer, len(ids)) for ex, ids, answer in
                     zip(self.validation, self.tokenizer(prompts, add_special_tokens=False)["input_ids"], answers)]
            return acceptance_model(model, items, self.pad_id).to_dict()

        return AcceptanceModel.from_dict(self.cached("acceptance", self.eval_key(model_key(ss_dir)) + " acceptance",
                                                     compute))

    def calibration_sources(self) -> list[str]:
        return [ex.source for ex in self.validation[: self.args.calibration_inputs]]

    def calibrate_torch(self, ss_dir: Path, acceptance: AcceptanceModel) -> BackendCalibration:
        """Step costs of the best tree of every size on this machine (the torch backend runs any tree)."""
        def compute() -> dict:
            return in_fresh_process(calibrate_sources, ss_dir, "torch", self.calibration_sources(), self.args.threads,
                                    CALIBRATION_TOKENS, acceptance.to_dict())

        model = hashlib.sha256(json.dumps(acceptance.to_dict()).encode()).hexdigest()[:16]
        key = json.dumps([self.eval_key(model_key(ss_dir)), "calibrate torch", self.args.threads,
                          self.args.calibration_inputs, CALIBRATION_TOKENS, model])
        calibration = BackendCalibration.from_dict(self.cached("calibration-torch", key, compute))
        print(f"[calibrate] torch on {calibration.device}: {calibration.tree.num_nodes}-node tree, expected "
              f"{calibration.best.speedup(calibration.plain_seconds):.2f}x plain decoding", flush=True)
        return calibration

    def calibrate_artifact(self, artifact: Path, acceptance: AcceptanceModel,
                           torch_calibration: BackendCalibration) -> None:
        """The acceptance model into the manifest, then each backend that runs here times the artifact's
        trees; its choice goes into the manifest (kept while the acceptance model is the same)."""
        opened = Artifact.open(artifact)
        opened.save_acceptance(acceptance)
        opened.save_calibration("torch", torch_calibration)
        for files, backend in RUNS_HERE.items():
            if files not in opened.manifest["files"]:
                continue
            if opened.calibration(backend) is None:
                data = in_fresh_process(calibrate_sources, artifact, backend, self.calibration_sources(),
                                        self.args.threads, CALIBRATION_TOKENS)
                opened.save_calibration(backend, BackendCalibration.from_dict(data))
            else:
                print(f"[calibrate] reusing {backend}'s calibration in {artifact / 'manifest.json'}", flush=True)

    # --- export, verify, profile ----------------------------------------------------------
    def export(self, ss_dir: Path, export: ExportConfig, summary: dict) -> Path:
        out = self.args.out
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in self.test_prompts]
        info = {"preset": self.config.preset, "eval": summary}
        ArtifactBuilder(ss_dir, out, export, prompts, self.config.eval.max_new_tokens, info,
                        self.draft_vocab(export.draft_vocab)).build()
        return out

    def draft_vocab(self, size: int) -> DraftVocab | None:
        """From the training prompts and answers; coverage measured on the validation answers."""
        answers = [item.input_ids[item.prompt_len :] for item in self.validation_items]
        draft = draft_vocab([item.input_ids for item in self.train_items], answers, size, len(self.tokenizer))
        if draft is not None:
            print(f"[export] draft vocabulary: {len(draft.ids)} tokens, {100 * draft.coverage:.1f}% of validation "
                  f"answer tokens", flush=True)
        return draft

    def profile(self, artifact: Path) -> dict | None:
        """SS vs plain on the first --profile-limit test inputs, with the fastest backend here (calibrated)."""
        limit = self.args.profile_limit
        backend = fastest_backend(artifact)
        manifest = Artifact.open(artifact).manifest
        stored = manifest.get("profile")
        if stored and stored.get("limit") == limit and stored.get("backend_choice") == backend:
            print(f"[profile] reusing the profile in {artifact / 'manifest.json'}", flush=True)
            result = stored
        else:
            sources = [(ex.id, ex.source) for ex in self.test[: limit + 1]]  # +1: the untimed warm-up input
            # A fresh process: its peak memory is the runtime's own, not this one's from training.
            result = in_fresh_process(profile_artifact, artifact, backend, sources, self.config.eval.max_new_tokens,
                                      self.args.threads, artifact.parent / f"{artifact.name}-profile")
            result.update(limit=limit, backend_choice=backend)
            Artifact.open(artifact).update(profile=result)
        if result["bench"]["mismatched_inputs"]:
            raise ParityError(f"profile: SS differs from plain decoding on {backend} for test inputs "
                              f"{', '.join(result['bench']['mismatched_inputs'])} (recorded in {artifact}/manifest.json "
                              f"under profile): the artifact is not lossless; report it with that manifest")
        return result

    def evaluate_zero_shot(self) -> dict:
        def compute() -> dict:
            base, _ = load_base_model(self.args.base_model)
            return {"test": self.quality(packed_for_inference(base), "zero-shot")}

        return self.cached("zero_shot", self.eval_key(f"zero-shot:{self.args.base_model}"), compute)


# Cached evaluations (eval/*.json under the run folder) of another format are computed again.
EVAL_FORMAT = "eval/2"

# Tokens per timed calibration run: enough steps for a median, few enough that 15 candidate trees on 4
# inputs take a few minutes on 2 cores.
CALIBRATION_TOKENS = 48


def in_fresh_process(function, *args):
    """function(*args) in a spawned process: a measurement there sees the runtime alone, not this
    process's training memory or its threads."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = cli.usage(lambda: build_config(args))
    export = cli.usage(lambda: export_config(args))  # bad export flags fail before hours of training
    build = Build(args, config)
    with exclusive(build.run_dir), exclusive(args.out):  # one build per checkpoint run and artifact folder
        return run_build(args, config, export, build)


def run_build(args: argparse.Namespace, config: BuildConfig, export: ExportConfig, build: "Build") -> int:
    build.load_data()
    # The model users open is always <run>/ss; with self-distillation, its first stage sits beside it.
    ss_dir = build.ensure_trained("ss_stage1" if config.distill.enabled else "ss", with_streams=True)
    if config.distill.enabled:
        ss_dir = build.ensure_distilled(ss_dir)
    baseline_dir = None if args.skip_baseline else build.ensure_trained("lora_baseline", with_streams=False)
    results = {"ss": build.evaluate_checkpoint(ss_dir, "ss", with_streams=True)}
    if baseline_dir is not None:
        results["lora_baseline"] = build.evaluate_checkpoint(baseline_dir, "lora_baseline", with_streams=False)
    if not args.skip_zero_shot:
        results["zero_shot"] = build.evaluate_zero_shot()
    summary = report.summarise(build, ss_dir, baseline_dir, results)
    report.write_json(ss_dir / "eval.json", summary)
    report.write_json(build.run_dir / "eval.json", summary)
    print(report.markdown(summary), flush=True)
    print(f"[done] eval.json written to {ss_dir / 'eval.json'}", flush=True)
    if [b for b in export.backends if b != "torch"]:
        acceptance = build.acceptance(ss_dir)
        torch_calibration = build.calibrate_torch(ss_dir, acceptance)
        if args.tree is None:  # the graphs get the trees calibration picks
            chosen = trees_to_export(acceptance, torch_calibration, quantized=export.quantize != "none")
            export = dataclasses.replace(export, trees=tuple(tree_text(tree) for tree in chosen))
        artifact = build.export(ss_dir, export, summary)
        build.calibrate_artifact(artifact, acceptance, torch_calibration)
        print(report.artifact_markdown(Artifact.open(artifact).manifest), flush=True)
        print(report.calibration_markdown(Artifact.open(artifact).manifest), flush=True)
        if args.profile_limit > 0:
            build.profile(artifact)
            print(report.profile_markdown(Artifact.open(artifact).manifest), flush=True)
        print(f"[done] artifact: {artifact}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main, prog="build.py"))
