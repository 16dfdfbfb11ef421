"""Write an exported artifact (format: runtime/artifact/format.py) from a fine-tuned checkpoint.

Stages run in a staging folder beside the target, each leaving a marker when complete, so an
interrupted build resumes where it stopped; the folder is renamed into place only when every
backend is exported and verified, so a half-built artifact never loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from streamfuse.adapters.checkpoint import load_checkpoint, read_manifest, weights_digest
from streamfuse.export import graph, worker
from streamfuse.export.artifact_manifest import ManifestRecord
from streamfuse.export.artifact_parity import ParityGate, parity_stage
from streamfuse.export.backend_export import BackendExports, tensors_stage
from streamfuse.export.draft_vocab import DraftVocab
from streamfuse.export.formats import (  # noqa: F401  (the export's settings: callers import them from here)
    BACKENDS,
    DEFAULT_BACKENDS,
    FORMATS,
    ONNX_LINEARS,
    PTE_LINEARS,
    RUNS_HERE,
    SPAN,
    TASK_INPUT_FORMATS,
)
from streamfuse.export.task_adder import TaskAdder, model_shape
from streamfuse.methods.medusa.model import load_heads, read_heads_manifest
from streamfuse.runtime.artifact.contract import GraphSpec, method_names, parse_batches
from streamfuse.runtime.artifact.durable import replace_folder, write_atomic
from streamfuse.runtime.artifact.format import (
    DRAFT_VOCAB,
    HEAD_VOCAB,
    LOCK,
    MANIFEST,
    SCHEMA,
    TASKS,
    Artifact,
    ArtifactError,
    file_digest,
    lock,
    save_vocab,
    write_manifest,
)
from streamfuse.runtime.speculation.tree import TreeSpec


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all: a temporary file of its own (export workers write beside each other), renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=2).encode())


@dataclass(frozen=True)
class ExportConfig:
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    # The artifact's draft trees (data, not graphs), the default first: the build puts its calibrated
    # choices here (training/calibration.py); without them, the 4-node chain (the fastest fixed tree on CPUs
    # measured). Every tree must fit the largest bucket.
    trees: tuple[str, ...] = ("gamma=3,k=1",)
    # Row counts with step graphs (export/graph.py): any tree of up to T nodes runs in bucket T, padded.
    # Each bucket adds two methods to lower; 4 and 8 hold the trees CPUs calibrate to (docs/benchmarks.md).
    buckets: tuple[int, ...] = (4, 8)
    # KV rows: a prompt, its answer and one tree. A call pays for the rows in use, not for this (the attention kernel
    # reads the used span; the host's cache pages are touched as rows fill), so it leaves room for long sources.
    capacity: int = 2048
    prefill_chunk: int = 64
    quantize: str = "none"  # weights: none | int8 | 8da4w | q4-native, where a backend offers it (FORMATS)
    coreml_precision: str = "float16"
    parity_prompts: int = 20
    draft_vocab: int = 16384  # greedy_step's draft vocabulary size (export/draft_vocab.py); 0: all tokens
    greedy_schedule: str = "auto"  # greedy_step's streams: fused | deferred | auto (by tree size)
    # Export processes. Lowering and conversion are mostly single-threaded Python, so a second
    # process keeps a second core busy (~5 min less on a 2-core build, one more model in memory).
    workers: int = 1
    # The task's trained tensors as graph inputs (export/task_inputs.py): other tasks on the same base can join
    # the artifact (--task a,b sets it). Off for one task: XNNPACK repacks an input weight on every call, which
    # makes a decode call slower (docs/export.md, "Several tasks on one base").
    task_inputs: bool = False
    # q4-native's linears on ONNX Runtime: streamfuse's own 4-bit op (one node, runtime/ops/q4_linear.py) or ONNX
    # Runtime's MatMulNBits with an fp32 low-rank term for the minimums and the LoRA (4 nodes)
    onnx_linear: str = "streamfuse"
    # ... and on ExecuTorch: XNNPACK's 8da4w with fp32 side terms (one delegate call for the whole method), or
    # streamfuse's op, which runs outside the delegate (the graph between the linears splits into many)
    pte_linear: str = "xnnpack"
    # The batched steps of the engine-cache graphs (ExecuTorch, ONNX Runtime): "BxT,..." (e.g. "2x1,4x1,4x4"), B
    # sequences of T rows each (1: decode rows, else a bucket) in one call (export/batch_pass.py); "": none.
    batches: str = ""

    def validate(self) -> None:
        if not self.trees:
            raise ValueError("export.trees is empty: give at least one draft tree")
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
        if self.quantize not in FORMATS:
            raise ValueError(f"export.quantize (--quantize) must be one of {', '.join(FORMATS)}, got {self.quantize!r}")
        if self.workers < 1:
            raise ValueError(f"export.workers must be >= 1, got {self.workers}")
        if self.onnx_linear not in ONNX_LINEARS:
            raise ValueError(f"export.onnx_linear must be one of {', '.join(ONNX_LINEARS)}, got {self.onnx_linear!r}")
        if self.pte_linear not in PTE_LINEARS:
            raise ValueError(f"export.pte_linear must be one of {', '.join(PTE_LINEARS)}, got {self.pte_linear!r}")
        other = [b for b in self.backends if b != "torch" and b not in FORMATS[self.quantize]]
        if self.task_inputs and (self.quantize not in TASK_INPUT_FORMATS or other):
            raise ValueError(
                f"export.task_inputs (several tasks on one base) needs graphs without the task's weights: "
                f"--quantize {' or '.join(TASK_INPUT_FORMATS)} and only backends that build it "
                f"({', '.join(FORMATS[TASK_INPUT_FORMATS[0]])}), not {self.quantize} / {other}"
            )
        if self.draft_vocab < 0:
            raise ValueError(f"export.draft_vocab must be >= 0 (0: streams rank all tokens), got {self.draft_vocab}")
        shapes = graph.GraphShapes(self.capacity, self.prefill_chunk, self.buckets, batches=self.batch_shapes)
        graph.greedy_schedule(shapes.max_nodes, self.greedy_schedule)
        for tree in (TreeSpec.parse(tree) for tree in self.trees):
            if tree.num_nodes > shapes.max_nodes:
                raise ValueError(
                    f"export.trees has a tree of {tree.num_nodes} nodes, more than the largest of "
                    f"export.buckets ({shapes.max_nodes}): add a bucket of {tree.num_nodes} or more"
                )

    @property
    def batch_shapes(self) -> tuple[tuple[int, int], ...]:
        """(sequences, rows) of each batched step (`batches` parsed)."""
        return parse_batches(self.batches)

    def key(
        self,
        training_key: str,
        weights: str,
        draft: DraftVocab | None,
        heads_key: str | None = None,
        head: DraftVocab | None = None,
        graphs_only: bool = False,
        shape: dict | None = None,
    ) -> str:
        """What the artifact depends on: the checkpoint's settings and its weights (weights_digest), these
        settings, the draft vocabulary, the Medusa heads (their training key), the head's kept rows. The backend
        list is not part of it: an artifact with the same key lends its finished exports to a build that asks for
        more backends. graphs_only: what the exported files depend on, without the trees and the parity
        prompts (data the graphs take as inputs), so the files can be lowered before calibration."""
        payload = {
            "schema": SCHEMA,
            "training": training_key,
            "weights": weights,
            "methods": method_names(self.buckets, heads_key is not None, self.batch_shapes),
            "heads": heads_key,
            **asdict(self),
            "draft_ids": hashlib.sha256(json.dumps(draft.ids if draft else None).encode()).hexdigest(),
            "head_ids": hashlib.sha256(json.dumps(head.ids if head else None).encode()).hexdigest(),
        }
        for name in ("backends", "workers", *(("trees", "parity_prompts") if graphs_only else ())):
            payload.pop(name)
        if graphs_only and self.task_inputs:  # the trained tensors are inputs: the graphs hold the model's shape only
            payload.update(training=shape, weights=None)
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class ArtifactBuilder(BackendExports, ParityGate, ManifestRecord):
    """draft: greedy_step's draft vocabulary (export/draft_vocab.py; None: all tokens). heads: a Medusa
    heads folder (methods/medusa/model.py), which gives the graphs a heads method. The manifest's
    calibration section starts empty: the build's calibrate stage fills it (streamfuse build)."""

    def __init__(
        self,
        checkpoint: Path,
        out: Path,
        config: ExportConfig,
        prompts: list[list[int]],
        max_new_tokens: int,
        info: dict,
        draft: DraftVocab | None = None,
        prompt_names: Sequence[str] = (),
        heads: Path | None = None,
        head: DraftVocab | None = None,
        pending: dict[str, Future] | None = None,
    ):
        """head: the LM head's rows (a draft model's pruned vocabulary: its logits cover those tokens only).
        pending: backends whose files a worker lowers meanwhile (start_lowering), into this staging folder."""
        config.validate()
        # for workers
        self.arguments = (checkpoint, out, config, prompts, max_new_tokens, info, draft, prompt_names, heads, head)
        self.pending = dict(pending or {})
        self.checkpoint, self.out, self.config, self.draft, self.head = Path(checkpoint), Path(out), config, draft, head
        self.prompts, self.max_new_tokens, self.info = prompts[: config.parity_prompts], max_new_tokens, info
        self.prompt_names = tuple(prompt_names)[: config.parity_prompts]  # for a parity failure's message
        self.heads = None if heads is None else Path(heads)
        heads_manifest = None if heads is None else read_heads_manifest(self.heads)
        self.num_heads = 0 if heads_manifest is None else heads_manifest["num_heads"]
        self.heads_key = None if heads_manifest is None else heads_manifest["info"].get("training_key", "untracked")
        trained = read_manifest(checkpoint)
        self.task = trained["info"].get("task")
        identity = (
            trained["info"].get("training_key", "untracked"),
            weights_digest(checkpoint),
            draft,
            self.heads_key,
            head,
        )
        self.key = config.key(*identity)
        self.graph_key = config.key(*identity, graphs_only=True, shape=model_shape(trained))
        # Keyed by the graphs: files lowered before calibration chose the trees are this build's files.
        self.staging = self.out.parent / f".{self.out.name}.partial-{self.graph_key}"
        self.task_folder = self.staging / TASKS / str(self.task)  # where this task's files are staged
        self.graphs_in: Path | None = None  # where the graph files are when not staged here (TaskAdder)
        self._model = None
        self._expected = None

    def existing_graphs(self) -> dict | None:
        """The manifest of a finished artifact whose files have these graphs (any trees), if there is one."""
        if not (self.out / MANIFEST).is_file():
            return None
        try:
            manifest = Artifact.open(self.out).manifest
        except ArtifactError as error:  # another schema: replaced once this build is complete
            print(f"[export] {self.out} will be replaced: {error}", flush=True)
            return None
        return manifest if manifest["graphs"].get("key") == self.graph_key else None

    def build(self) -> dict:
        lending = self.existing_graphs()  # its files have these graphs; its parity counts if its trees are these
        if lending is not None and self.task != lending["task"]:  # another task's graphs: this task joins them
            return TaskAdder(self).add()
        if lending is None:
            self._keep_other_tasks()
        manifest = lending if lending is not None and lending["build_key"] == self.key else None
        wanted = {b for b in self.config.backends if b != "torch"}
        if manifest is not None and wanted <= set(manifest["files"]):
            print(f"[export] reusing {self.out} (same checkpoint and settings)", flush=True)
            for job in self.pending.values():
                job.result()
            shutil.rmtree(self.staging, ignore_errors=True)  # what a lowering started before this check wrote
            return manifest
        (self.staging / "done").mkdir(parents=True, exist_ok=True)
        if not self.pending:  # a pending worker cleared the folder when it started, and writes into it now
            self._clear_scratch()
        earlier = list(lending["files"]) if lending is not None else []
        if lending is not None:
            self._seed(lending)
        self._stage("common", self._copy_common)
        backends = list(dict.fromkeys([*earlier, *(b for b in self.config.backends if b != "torch")]))
        exported = self._export_stages(backends)
        files = {backend: done["files"] for backend, done in exported.items()}
        formats = {backend: done["format"] for backend, done in exported.items()}
        seconds = {backend: done["seconds"] for backend, done in exported.items()}
        task_files = {
            b: self._stage(tensors_stage(b, self.key), lambda b=b: self._task_file(b))["file"]
            for b in backends
            if self.config.task_inputs
        }
        parity = {backend: self._parity_stage(backend, files[backend]) for backend in backends if backend in RUNS_HERE}
        self._gate(parity)
        manifest = self._manifest(files, parity, seconds, formats, task_files, lending)
        write_manifest(self.staging, manifest)
        self._swap_in()
        return manifest

    def _swap_in(self) -> None:
        """The staged artifact in place of the old one (renamed aside, deleted after), under the old one's lock: a
        tools.calibrate writing meanwhile finishes first, or finds the new build and says so."""
        if self.out.is_dir():
            with lock(self.out):
                replace_folder(self.staging, self.out)
        else:
            replace_folder(self.staging, self.out)
        shutil.rmtree(self.out / "done")  # kept until the rename, so an interrupted swap still resumes

    def _keep_other_tasks(self) -> None:
        """Refuse to replace an artifact that serves another task with graphs this task cannot join."""
        try:
            manifest = Artifact.open(self.out).manifest
        except ArtifactError:  # none there, or another schema: replaced
            return
        if manifest["task"] == self.task:
            if manifest[TASKS]:
                print(
                    f"[export] {self.out}'s graphs change: its other tasks ({', '.join(manifest[TASKS])}) go with "
                    f"them; build them again into it (streamfuse build --task ... --out {self.out})",
                    flush=True,
                )
            return
        why = (
            "its graphs hold its task's weights (built without export.task_inputs)"
            if not manifest["task_files"]
            else "its graphs were built with other settings, base or streams"
        )
        raise ArtifactError(
            f"{self.out} serves task {manifest['task']}, and task {self.task} cannot join it: {why}; "
            f"give --out another folder, or build the tasks together (--task {manifest['task']},"
            f"{self.task})"
        )

    # --- stages -----------------------------------------------------------------------------
    def _clear_scratch(self) -> None:
        """What a killed export left half-written (a process killed for memory runs no cleanup): the
        Core ML packages of single methods (3.9 GB for SmolLM2) and unfinished programs, which the
        finished artifact would otherwise carry."""
        from streamfuse.export.to_coreml import SCRATCH_PREFIX

        for leftover in [*self.staging.glob(f"{SCRATCH_PREFIX}*"), *self.staging.glob("*.tmp")]:
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()

    def _seed(self, manifest: dict) -> None:
        """Start from the finished artifact's exports (hard links: the artifact stays intact)."""
        for item in self.out.iterdir():
            if item.name not in (MANIFEST, LOCK) and not (self.staging / item.name).exists():
                if item.is_dir():
                    shutil.copytree(item, self.staging / item.name, copy_function=os.link)
                else:
                    os.link(item, self.staging / item.name)
        done = {"common": {}}
        for backend, files in manifest["files"].items():
            done[backend] = {
                "files": files,
                "seconds": manifest["export_seconds"][backend],
                "format": manifest["graphs"]["formats"][backend],
            }
            if backend in manifest["parity"] and manifest["build_key"] == self.key:
                done[parity_stage(backend, self.key)] = manifest["parity"][backend]
        for name, result in done.items():
            (self.staging / "done" / f"{name}.json").write_text(json.dumps(result))

    def _export_stages(self, backends: list[str]) -> dict[str, dict]:
        """Every backend's export stage; with workers > 1, those after the first run in a worker
        process meanwhile, with their parity checks (the first, ExecuTorch by default, takes
        about as long as the rest to lower); the first's parity runs here while the worker ends."""
        if self.pending:  # those lowered elsewhere end while the others export and verify here
            here = {b: self._stage(b, lambda b=b: self._export(b)) for b in backends if b not in self.pending}
            for backend, result in here.items():
                self._parity_stage(backend, result["files"])
            for job in self.pending.values():
                job.result()  # re-raises the worker's error here
            return {b: json.loads(self._marker(b).read_text()) for b in backends}
        beside = [b for b in backends[1:] if not self._marker(b).is_file()]
        if self.config.workers < 2 or not beside:
            return {
                b: self._stage(b, lambda b=b: self._export(b)) for b in tqdm(backends, desc="export", unit="backend")
            }
        print(f"[export] {', '.join(beside)} in a worker process beside {backends[0]}", flush=True)
        job = worker.start(export_stages, self.arguments, beside)
        first = self._stage(backends[0], lambda: self._export(backends[0]))
        self._parity_stage(backends[0], first["files"])
        job.result()  # re-raises the worker's error here
        return {backends[0]: first, **{b: json.loads(self._marker(b).read_text()) for b in backends[1:]}}

    def _marker(self, name: str) -> Path:
        return self.staging / "done" / f"{name}.json"

    def _stage(self, name: str, run) -> dict:
        marker = self._marker(name)
        if marker.is_file():
            print(f"[export] {name}: done earlier, reusing", flush=True)
            return json.loads(marker.read_text())
        start = time.perf_counter()
        result = run() or {}
        result["seconds"] = round(time.perf_counter() - start, 1)
        write_json(marker, result)
        print(f"[export] {name}: {result['seconds']:.0f} s", flush=True)
        return result

    def _copy_common(self) -> dict:
        _, tokenizer, _ = self.model_and_tokenizer()
        for name in ("tokenizer", "adapter"):
            shutil.rmtree(self.staging / name, ignore_errors=True)
        tokenizer.save_pretrained(self.staging / "tokenizer")
        if self.head is not None:
            save_vocab(self.staging / HEAD_VOCAB, self.head.ids)
        if self.draft is not None:  # a task added later drafts from the same rows of the head (the graphs hold them)
            save_vocab(self.staging / DRAFT_VOCAB, self.draft.ids)
        shutil.copytree(
            self.checkpoint, self.staging / "adapter", ignore=shutil.ignore_patterns("*.snapshot", "eval", "*.tmp")
        )
        return {}

    # --- shared state -----------------------------------------------------------------------
    def model_and_tokenizer(self):
        if self._model is None:
            model, tokenizer, manifest = load_checkpoint(self.checkpoint, merge_lora=True)
            self._keep_head(model)
            self._model = (model.eval().requires_grad_(False), tokenizer, manifest)
        return self._model

    def _keep_head(self, model) -> None:
        if self.head is not None:
            model.keep_vocab(torch.tensor(self.head.ids))

    def shapes(self, span: bool = False) -> graph.GraphShapes:
        config = self.config
        return graph.GraphShapes(
            config.capacity, config.prefill_chunk, config.buckets, span, batches=config.batch_shapes
        )

    @property
    def trees(self) -> tuple[TreeSpec, ...]:
        return tuple(TreeSpec.parse(tree) for tree in self.config.trees)

    def greedy_schedules(self) -> list[str]:
        return [graph.greedy_schedule(rows, self.config.greedy_schedule) for rows in self.config.buckets]

    def modules(self, model, span: bool = False) -> dict:
        return graph.graph_modules(
            model,
            self.shapes(span),
            self.draft.ids if self.draft else None,
            self.greedy_schedules(),
            self.medusa_heads(),
        )

    def medusa_heads(self) -> torch.nn.Module | None:
        """The Medusa heads the graphs rank (fp32 whatever the format: about 1M weights), or None."""
        return None if self.heads is None else load_heads(self.heads).eval().requires_grad_(False)

    def graph_spec(self, backend: str) -> GraphSpec:
        return graph.graph_spec(
            self.model_and_tokenizer()[0], self.shapes(span=backend in SPAN), self.greedy_schedules(), self.num_heads
        )

    def _entry(self, path: Path) -> dict:
        return {"path": str(path.relative_to(self.staging)), **file_digest(path)}


def install_drafter(artifact: Path, method: str, checkpoint: Path, entry: dict) -> None:
    """Copy a method's drafter checkpoint into <artifact>/drafters/<method>/ and record it in the
    manifest: an artifact gains a method without its graphs or SS being rebuilt. The copy is staged
    beside the target and renamed into place, so a reader never meets half of it."""
    opened = Artifact.open(artifact)
    target = opened.path / "drafters" / method
    target.parent.mkdir(exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{method}.partial-", dir=target.parent))
    try:
        shutil.copytree(checkpoint, staging / method, ignore=shutil.ignore_patterns("*.snapshot", "eval", "*.tmp"))
        digest = file_digest(staging / method)
        with lock(opened.path):  # the folder and its record change together
            replace_folder(staging / method, target)
            opened.record_drafter(method, {**entry, "path": f"drafters/{method}", **digest})
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def start_lowering(arguments: tuple, backends: Sequence[str]) -> dict[str, Future]:
    """Lower `backends`' files in a worker process now, for the ArtifactBuilder of these arguments (any
    trees: the graphs take them as inputs), while the build evaluates and calibrates; pass the result
    as its `pending`. Nothing starts for backends whose files the finished artifact already has."""
    builder = ArtifactBuilder(*arguments)
    manifest = builder.existing_graphs()
    todo = [b for b in backends if b not in (manifest or {}).get("files", {})]
    if not todo:
        return {}
    print(f"[export] lowering {', '.join(todo)} in a worker process while the build goes on", flush=True)
    job = worker.start(lower_stages, arguments, todo)
    return dict.fromkeys(todo, job)


def lower_stages(arguments: tuple, backends: list[str]) -> None:
    """In a worker process: each backend's export stage, into the staging folder (markers as the parent's).
    One thread: the parent uses the other core."""
    torch.set_num_threads(1)
    builder = ArtifactBuilder(*arguments)
    (builder.staging / "done").mkdir(parents=True, exist_ok=True)
    builder._clear_scratch()
    for backend in backends:
        builder._stage(backend, lambda b=backend: builder._export(b))


def export_stages(arguments: tuple, backends: list[str]) -> None:
    """In a worker process: each backend's export stage, then its parity check if it runs here,
    into the parent's staging folder (each leaves its marker, which the parent reads). ONNX's
    parity right after its export computes the eager oracle tokens while ExecuTorch still lowers,
    so the parent finds them ready (both computed them when Core ML's export came in between).
    One thread: the parent uses the other core."""
    torch.set_num_threads(1)
    builder = ArtifactBuilder(*arguments)
    for backend in backends:
        result = builder._stage(backend, lambda b=backend: builder._export(b))
        builder._parity_stage(backend, result["files"])
