"""The build, driven by training/build.py: data, the trained stages (training/stages.py: train, distil,
each enabled method's build part), evaluate, calibrate, export, verify and profile, then each method's
drafter into the artifact, each reusing its output when rerun with the same settings."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from streamfuse.adapters.base_model import load_base_model
from streamfuse.adapters.checkpoint import load_checkpoint
from streamfuse.adapters.lora import add_lora
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export import worker
from streamfuse.export.artifact import RUNS_HERE, ArtifactBuilder, ExportConfig, start_lowering, write_json
from streamfuse.export.draft_vocab import DraftVocab, coverage, draft_vocab
from streamfuse.export.verify import ParityError
from streamfuse.runtime.artifact.format import Artifact, ArtifactError
from streamfuse.runtime.measure.timing import calibrate_sources
from streamfuse.runtime.request.loader import fastest_backend
from streamfuse.runtime.speculation.calibration import AcceptanceModel, BackendCalibration
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.training import build_part, report, stages
from streamfuse.training.calibration import acceptance_model, tree_text, trees_to_export
from streamfuse.training.config import BuildConfig
from streamfuse.training.data import Encoded, encode, prompt_text
from streamfuse.training.distill import distill_rows, self_distilled
from streamfuse.training.evaluation import (
    answer_quality,
    greedy_answer_ids,
    packed_for_inference,
    stream_accuracy,
    task_quality,
)
from streamfuse.training.frozen_states import FrozenStates
from streamfuse.training.profiling import profile_artifact
from streamfuse.training.tasks import get_task
from streamfuse.training.tasks.base import UNLABELLED


class Build:
    def __init__(self, args: argparse.Namespace, config: BuildConfig):
        self.args, self.config = args, config
        self.task = get_task(args.task)
        self.run_dir = args.work_dir / f"{self.task.name}-{config.preset}"
        _, self.tokenizer = load_base_model(args.base_model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.frozen_states = FrozenStates()  # every model of this build sits on the same base model
        self.pending: dict = {}  # backend -> its lowering under way in a worker (start_lowering)

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
        print(
            f"[data] {self.task.name}: {len(self.train_items)} train ({tokens} tokens), "
            f"{len(self.validation_items)} validation, {len(self.test)} test",
            flush=True,
        )

    def _encode(self, example):
        data = self.config.data
        return encode(self.task, self.tokenizer, example, data.max_source_tokens, data.max_target_tokens)

    # --- models and answers the stages share (training/stages.py) ------------------------
    def new_model(self) -> SpeculativeStreamingLM:
        """The base model with fresh LoRA, streams and pruning head, initialised from the training
        seed: libraries reseed torch's generator at import, so without it no two builds match."""
        base, _ = load_base_model(self.args.base_model)
        torch.manual_seed(self.config.train.seed)
        return SpeculativeStreamingLM(add_lora(base, self.config.lora), self.config.streams)

    def own_answers(self, model, key: str, examples, split: str) -> list[Encoded]:
        """Prompt + the model's own greedy answer for each example, cached per model and split."""
        prompts = [prompt_text(self.task, self.tokenizer, ex, self.config.data.max_source_tokens) for ex in examples]
        cache = self.run_dir / "distill" / f"{key}-{split}.jsonl"
        return self_distilled(
            model.model,
            self.tokenizer,
            [ex.id for ex in examples],
            prompts,
            self.config.data.max_target_tokens,
            self.config.distill.batch_size,
            cache,
            split,
        )

    def target_answers(
        self, target: SpeculativeStreamingLM, target_key: str, unlabelled: bool
    ) -> tuple[list[Encoded], int]:
        """The SS model's own greedy answers that finished (prompt + answer), and how many it gave: what
        every other method's drafter learns, cached per model (the target features they share)."""
        answers = self.own_answers(target, target_key, self.train_examples, "train")
        if unlabelled:
            answers += self.own_answers(target, target_key, self.task.load(UNLABELLED, self.args.data_dir), UNLABELLED)
        items, _ = distill_rows(answers, [], self.tokenizer.eos_token_id, "own", self.config.data.max_target_tokens)
        return items, len(answers)

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
        write_json(path, {"key": key, "result": result})
        return result

    def eval_key(self, checkpoint_key: str) -> str:
        data = self.config.data
        return json.dumps(
            [
                EVAL_FORMAT,
                checkpoint_key,
                dataclasses.asdict(self.config.eval),
                data.test_limit,
                data.validation_limit,
                data.max_source_tokens,
            ]
        )

    def quality(self, model, label: str) -> dict:
        ev = self.config.eval
        return task_quality(
            model, self.tokenizer, self.task, self.test, self.test_prompts, ev.max_new_tokens, ev.batch_size, label
        )

    def evaluate_checkpoint(self, directory: Path, label: str, with_streams: bool) -> dict:
        key = stages.model_key(directory)

        def compute() -> dict:
            model = self.inference_model(directory)
            if not with_streams:
                return {"test": self.quality(model.model, label)}
            ev = self.config.eval
            answers = greedy_answer_ids(
                model.model, self.tokenizer, self.test_prompts, ev.max_new_tokens, ev.batch_size, f"generate {label}"
            )
            # Own answers: the test answers just scored, so no second generation (~1.5 min on 2 cores).
            prompt_ids = self.tokenizer(list(self.test_prompts), add_special_tokens=False)["input_ids"]
            own = [Encoded(ex.id, ids + answer, len(ids)) for ex, ids, answer in zip(self.test, prompt_ids, answers)]
            return {
                "test": answer_quality(self.tokenizer, self.task, self.test, answers),
                "stream_accuracy": stream_accuracy(model, self.validation_items, self.pad_id, ev.top_k),
                "stream_accuracy_own": stream_accuracy(model, own, self.pad_id, ev.top_k),
            }

        return self.cached(label, self.eval_key(key), compute)

    # --- calibrate --------------------------------------------------------------------------
    def acceptance(self, ss_dir: Path) -> AcceptanceModel:
        """The acceptance model: the SS model's own greedy answers to the validation inputs, their
        stream ranks teacher-forced (training/calibration.py); cached with the evaluations."""

        def compute() -> dict:
            model = self.inference_model(ss_dir)
            ev = self.config.eval
            prompts = [
                prompt_text(self.task, self.tokenizer, ex, self.config.data.max_source_tokens) for ex in self.validation
            ]
            answers = greedy_answer_ids(
                model.model, self.tokenizer, prompts, ev.max_new_tokens, ev.batch_size, "generate validation"
            )
            items = [
                Encoded(ex.id, ids + answer, len(ids))
                for ex, ids, answer in zip(
                    self.validation, self.tokenizer(prompts, add_special_tokens=False)["input_ids"], answers
                )
            ]
            return acceptance_model(model, items, self.pad_id).to_dict()

        key = self.eval_key(stages.model_key(ss_dir)) + " acceptance"
        return AcceptanceModel.from_dict(self.cached("acceptance", key, compute))

    def calibration_sources(self) -> list[str]:
        return [ex.source for ex in self.validation[: self.config.stages.calibration_inputs]]

    def calibrate_torch(self, ss_dir: Path, acceptance: AcceptanceModel) -> BackendCalibration:
        """Step costs of the best tree of every size on this machine (the torch backend runs any tree)."""

        def compute() -> dict:
            return worker.run(
                calibrate_sources,
                ss_dir,
                "torch",
                self.calibration_sources(),
                self.args.threads,
                CALIBRATION_TOKENS,
                acceptance.to_dict(),
            )

        model = hashlib.sha256(json.dumps(acceptance.to_dict()).encode()).hexdigest()[:16]
        key = json.dumps(
            [
                self.eval_key(stages.model_key(ss_dir)),
                "calibrate torch",
                self.args.threads,
                self.config.stages.calibration_inputs,
                CALIBRATION_TOKENS,
                model,
            ]
        )
        calibration = BackendCalibration.from_dict(self.cached("calibration-torch", key, compute))
        print(
            f"[calibrate] torch on {calibration.device}: {calibration.tree.num_nodes}-node tree, expected "
            f"{calibration.best.speedup(calibration.plain_seconds):.2f}x plain decoding",
            flush=True,
        )
        return calibration

    def calibrate_artifact(
        self, artifact: Path, acceptance: AcceptanceModel, torch_calibration: BackendCalibration
    ) -> None:
        """The acceptance model into the manifest, then each backend that runs here times the artifact's
        trees; its choice goes into the manifest (kept while the acceptance model is the same)."""
        opened = Artifact.open(artifact, self.task.name)
        opened.save_acceptance(acceptance)
        opened.save_calibration("torch", torch_calibration)
        for backend in RUNS_HERE:
            if backend not in opened.manifest["files"]:
                continue
            if opened.calibration(backend) is None:
                data = worker.run(
                    calibrate_sources,
                    artifact,
                    backend,
                    self.calibration_sources(),
                    self.args.threads,
                    CALIBRATION_TOKENS,
                    None,
                    self.task.name,
                )
                opened.save_calibration(backend, BackendCalibration.from_dict(data))
            else:
                print(f"[calibrate] reusing {backend}'s calibration in {artifact / 'manifest.json'}", flush=True)

    # --- export, verify, profile ----------------------------------------------------------
    def builder_arguments(self, ss_dir: Path, export: ExportConfig, info: dict, heads: Path | None = None) -> tuple:
        return (
            ss_dir,
            self.args.out,
            export,
            self.parity_prompts(),
            self.config.eval.max_new_tokens,
            info,
            self.draft_vocab(export.draft_vocab),
            [ex.id for ex in self.test],
            heads,
        )

    def start_lowering(self, ss_dir: Path) -> None:
        """The first exported backend's files (ExecuTorch's by default: the longest export) from the SS
        checkpoint, lowered in a worker from now on, while evaluation and calibration run: the graphs take
        the trees as inputs, so calibration need not come first. Not with Medusa heads: they are trained
        later and give the graphs a method (a build part's `heads`)."""
        export = self.config.export
        first = [b for b in export.backends if b != "torch"][:1]
        if not first or any(part.heads for part in build_part.enabled(self.config)):
            return
        export = dataclasses.replace(
            export, buckets=with_method_buckets(export.buckets, self.config), trees=(tree_text(TreeSpec.chain(1)),)
        )  # any tree: the graphs do not hold it
        self.pending = start_lowering(self.builder_arguments(ss_dir, export, {}), first)

    def export(self, ss_dir: Path, export: ExportConfig, summary: dict, heads: Path | None = None) -> Path:
        """The artifact; with heads (a build part's folder: Medusa's), its graphs get a heads method."""
        info = {"preset": self.config.preset, "eval": summary}
        pending = self.pending if heads is None else {}
        ArtifactBuilder(*self.builder_arguments(ss_dir, export, info, heads), pending=pending).build()
        return self.args.out

    def parity_prompts(self) -> list[list[int]]:
        """The test prompts' token ids: what an export's parity check decodes (its first export.parity_prompts)."""
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in self.test_prompts]

    def draft_vocab(self, size: int) -> DraftVocab | None:
        """greedy_step's: from the training prompts and answers; a task joining another's graphs takes theirs."""
        joined = self.joined_artifact()
        if joined is None:
            return self.vocab("draft", [item.input_ids for item in self.train_items], size)
        ids = joined.draft_ids()
        if ids is None:
            return None
        answers = [item.input_ids[item.prompt_len :] for item in self.validation_items]
        draft = DraftVocab(tuple(int(i) for i in ids), coverage(ids, answers))
        print(
            f"[export] draft vocabulary: task {joined.task}'s {len(ids)} tokens (the graphs hold them), "
            f"{100 * draft.coverage:.1f}% of validation answer tokens",
            flush=True,
        )
        return draft

    def joined_artifact(self) -> Artifact | None:
        """The artifact at --out when this build adds its task to another task's graphs (export.task_inputs)."""
        if not self.config.export.task_inputs:
            return None
        try:
            opened = Artifact.open(self.args.out)
        except (ArtifactError, OSError):
            return None
        return opened if opened.task != self.task.name and opened.manifest["task_files"] else None

    def vocab(self, label: str, texts: list[list[int]], size: int) -> DraftVocab | None:
        """The `size` tokens most frequent in `texts`; coverage measured on the validation answers."""
        answers = [item.input_ids[item.prompt_len :] for item in self.validation_items]
        draft = draft_vocab(texts, answers, size, len(self.tokenizer))
        if draft is not None:
            print(
                f"[export] {label} vocabulary: {len(draft.ids)} tokens, {100 * draft.coverage:.1f}% of validation "
                f"answer tokens",
                flush=True,
            )
        return draft

    def profile(self, artifact: Path) -> dict | None:
        """SS vs plain on the first --profile-limit test inputs, with the fastest backend here (calibrated)."""
        limit = self.config.stages.profile_limit
        backend = fastest_backend(artifact, self.task.name)
        manifest = Artifact.open(artifact, self.task.name).manifest
        stored = manifest.get("profile")
        if stored and stored.get("limit") == limit and stored.get("backend_choice") == backend:
            print(f"[profile] reusing the profile in {artifact / 'manifest.json'}", flush=True)
            result = stored
        else:
            sources = [(ex.id, ex.source) for ex in self.test[: limit + 1]]  # +1: the untimed warm-up input
            # A fresh process: its peak memory is the runtime's own, not this one's from training.
            own = Artifact.open(artifact).task == self.task.name  # another task's profile goes beside it
            folder = artifact.parent / (f"{artifact.name}-profile" + ("" if own else f"-{self.task.name}"))
            result = worker.run(
                profile_artifact,
                artifact,
                backend,
                sources,
                self.config.eval.max_new_tokens,
                self.args.threads,
                folder,
                self.task.name,
            )
            result.update(limit=limit, backend_choice=backend)
            Artifact.open(artifact, self.task.name).update(profile=result)
        if result["bench"]["mismatched_inputs"]:
            raise ParityError(
                f"profile: SS differs from plain decoding on {backend} for test inputs "
                f"{', '.join(result['bench']['mismatched_inputs'])} (recorded in "
                f"{artifact}/manifest.json under profile): the artifact is not lossless; report it with "
                f"that manifest"
            )
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


def with_method_buckets(buckets: tuple[int, ...], config: BuildConfig) -> tuple[int, ...]:
    """The export's buckets plus one that holds the longest chain an enabled build part verifies (sd's gamma
    drafts, specdec++'s max_drafts), where none does: its shorter chains run in the smaller buckets."""
    drafts = build_part.longest_chain(config)
    if drafts + 1 <= max(buckets):
        return buckets
    return (*buckets, drafts + 1)


def run_build(args: argparse.Namespace, config: BuildConfig, build: Build) -> int:
    build.load_data()
    # The model users open is always <run>/ss; with self-distillation, its first stage sits beside it.
    first = f"{stages.SS_MODEL}_stage1" if config.distill.enabled else stages.SS_MODEL
    ss_dir = stages.trained(build, first, with_streams=True)
    if config.distill.enabled:
        ss_dir = stages.distilled(build, ss_dir)
    build.start_lowering(ss_dir)  # the longest export, on one core, while the rest of the build goes on
    baseline_dir = stages.trained(build, "lora_baseline", with_streams=False) if config.stages.baseline else None
    results = {stages.SS_MODEL: build.evaluate_checkpoint(ss_dir, stages.SS_MODEL, with_streams=True)}
    if baseline_dir is not None:
        results["lora_baseline"] = build.evaluate_checkpoint(baseline_dir, "lora_baseline", with_streams=False)
    if config.stages.zero_shot:
        results["zero_shot"] = build.evaluate_zero_shot()
    trained = stages.method_stages(build, ss_dir)  # each enabled method's drafter, by config section
    summary = report.summarise(build, ss_dir, baseline_dir, results)
    write_json(ss_dir / "eval.json", summary)
    write_json(build.run_dir / "eval.json", summary)
    print(report.markdown(summary), flush=True)
    print(f"[done] eval.json written to {ss_dir / 'eval.json'}", flush=True)
    export = config.export
    if [b for b in export.backends if b != "torch"]:
        acceptance = build.acceptance(ss_dir)
        torch_calibration = build.calibrate_torch(ss_dir, acceptance)
        if not export.trees:  # the graphs get the trees calibration picks
            cheap = any(part.cheap_trees for part in build_part.enabled(config))
            chosen = trees_to_export(
                acceptance,
                torch_calibration,
                quantized=export.quantize != "none",
                max_nodes=max(export.buckets),
                cheap_trees=cheap,
            )
            export = dataclasses.replace(export, trees=tuple(tree_text(tree) for tree in chosen))
        export = dataclasses.replace(export, buckets=with_method_buckets(export.buckets, config))
        heads = [part.heads(trained[part.section]) for part in build_part.enabled(config) if part.heads]
        artifact = build.export(ss_dir, export, summary, heads[0] if heads else None)
        build.calibrate_artifact(artifact, acceptance, torch_calibration)
        opened = lambda: Artifact.open(artifact, build.task.name)  # noqa: E731  (this task's view, as written now)
        print(report.artifact_markdown(opened().manifest), flush=True)
        print(report.calibration_markdown(opened().manifest), flush=True)
        if config.stages.profile_limit > 0:
            build.profile(artifact)
            print(report.profile_markdown(opened().manifest), flush=True)
        for part in build_part.enabled(config):
            part.install(build, artifact, ss_dir, trained[part.section], export)
        print(f"[done] artifact: {artifact}", flush=True)
    return 0
