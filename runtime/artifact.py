"""The exported artifact's contract: manifest.json, read and checked before anything runs.

    <artifact>/manifest.json   schema, model dims, draft trees, calibration (acceptance model; per
                               backend: step costs and the chosen tree), graphs (methods, shapes),
                               KV layout, tokenizer, files (bytes + sha256), parity, eval, versions
    <artifact>/tokenizer/      the tokenizer the model was trained with
    <artifact>/head_vocab.safetensors  a draft model's artifact only: the token ids its LM head keeps
    <artifact>/adapter/        the fine-tuned checkpoint (LoRA + streams): the torch backend's input,
                               and what other tasks on the same base share
    <artifact>/drafters/<m>/   method m's drafter (sd: the draft model checkpoint, run on torch; medusa:
                               its heads, also in the graphs' heads method, graphs.heads)
    <artifact>/model.pte       ExecuTorch (XNNPACK), methods prefill/decode/streams, step_T/greedy_step_T per size
                               bucket T, the tree an input (and heads)
    <artifact>/onnx/           model.onnx (every method, one If branch each) + weights.bin
    <artifact>/model.mlpackage Core ML multifunction package (runs on macOS)
    <artifact>/model-coreml.pte ExecuTorch with the Core ML delegate (runs in an Apple app)
    <artifact>/tasks/<t>/      a task's tensors per engine (<engine>.safetensors: LoRA, streams, pruning head by
                               graph input name) where the graphs take them as inputs (q4-native); a task added
                               to the artifact also keeps its adapter/ here
The manifest's top level describes the artifact's own task (the one whose build made the graphs); `tasks`
holds every other task's own fields (TASK_FIELDS), and Artifact.open(path, task) reads the artifact as that
task sees it: the top level with the task's fields over it.
The runtime owns this format; export/ writes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamfuse.runtime.backends.static_graph import GraphSpec
from streamfuse.runtime.calibration import AcceptanceModel, BackendCalibration
from streamfuse.runtime.tree import TreeSpec

SCHEMA = "streamfuse.artifact/20"  # /20: q4-native graphs call streamfuse's Q4Linear / Q8Linear ops
MANIFEST = "manifest.json"
HEAD_VOCAB = "head_vocab.safetensors"  # "ids": the LM head's kept token ids, ascending (int64)
DRAFT_VOCAB = "draft_vocab.safetensors"  # "ids": greedy_step's draft vocabulary, ascending (int64)
TASKS = "tasks"  # <artifact>/tasks/<task>/: a task's tensor files (and an added task's adapter/)
# What each task has of its own; the rest (graphs, files, model, tokenizer, streams' shape) is the base's.
TASK_FIELDS = ("task", "prompt", "adapter", "task_files", "trees", "calibration", "drafters", "parity", "build_key",
               "created", "info", "profile")


class ArtifactError(ValueError):
    pass


def save_vocab(path: Path, ids) -> None:
    from safetensors.numpy import save_file

    save_file({"ids": np.asarray(ids, dtype=np.int64)}, str(path))


def task_names(manifest: dict) -> tuple[str, ...]:
    return (manifest["task"], *manifest[TASKS])


def write_manifest(folder: Path, manifest: dict) -> None:
    file, tmp = Path(folder) / MANIFEST, Path(folder) / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, file)


def file_digest(path: Path) -> dict:
    """bytes + sha256 of a file, or of a folder's files in sorted order (.mlpackage)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest, size = hashlib.sha256(), 0
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
                size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


@dataclass
class Artifact:
    """An artifact as one of its tasks sees it: `manifest` is the top level with that task's fields over it."""

    path: Path
    manifest: dict
    stored: dict | None = None  # the manifest as written (None: `manifest` is the artifact's own task's)

    @classmethod
    def open(cls, path: Path, task: str | None = None) -> "Artifact":
        """task: one of `tasks` (default: the artifact's own)."""
        path = Path(path)
        file = path / MANIFEST
        if not file.is_file():
            raise ArtifactError(f"{file} not found: {path} is not an exported artifact (build one with "
                                f"`python export/build.py --task dialogsum`)")
        try:
            manifest = json.loads(file.read_text())
        except json.JSONDecodeError as error:
            raise ArtifactError(f"{file} is not valid JSON ({error}); rebuild the artifact") from None
        if manifest.get("schema") != SCHEMA:
            raise ArtifactError(f"{file} has schema {manifest.get('schema')!r}; this streamfuse reads {SCHEMA!r}: "
                                f"rebuild the artifact with this version (export/build.py)")
        if task is None or task == manifest["task"]:
            return cls(path, manifest)
        if task not in manifest[TASKS]:
            raise ArtifactError(f"{path} has no task {task!r} (its tasks: {', '.join(task_names(manifest))}); add it with "
                                f"export/build.py --task {task} --out {path}")
        return cls(path, {**manifest, **manifest[TASKS][task]}, manifest)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The artifact's tasks, its own first."""
        return task_names(self.stored or self.manifest)

    @property
    def task(self) -> str:
        return self.manifest["task"]

    def for_task(self, task: str) -> "Artifact":
        return Artifact.open(self.path, task)

    def task_tensors(self, backend: str) -> dict[str, np.ndarray] | None:
        """The task's tensors for `backend`'s graphs by input name (None: its graphs hold them), checked
        against the manifest."""
        entry = self.manifest["task_files"].get(backend)
        if entry is None:
            return None
        file = self.path / entry["path"]
        if not file.is_file() or file_digest(file)["sha256"] != entry["sha256"]:
            raise ArtifactError(f"{file}: task {self.task}'s tensors for {backend} are missing or differ from the "
                                f"manifest; copy the artifact again or rebuild the task with export/build.py --task "
                                f"{self.task} --out {self.path}")
        from safetensors.numpy import load_file

        return load_file(file)

    def draft_ids(self) -> np.ndarray | None:
        """greedy_step's draft vocabulary (None: the streams rank every token)."""
        file = self.path / DRAFT_VOCAB
        if self.manifest["graphs"]["greedy_step"]["draft_vocab"] is None:
            return None
        from safetensors.numpy import load_file

        return load_file(file)["ids"]

    @property
    def trees(self) -> tuple[TreeSpec, ...]:
        """The artifact's draft trees, the build's default first (data: any tree up to the largest bucket runs)."""
        return tuple(TreeSpec.from_dict(tree) for tree in self.manifest["trees"])

    @property
    def tree(self) -> TreeSpec:
        return self.trees[0]

    @property
    def acceptance(self) -> AcceptanceModel | None:
        data = self.manifest["calibration"]["acceptance"]
        return AcceptanceModel.from_dict(data) if data else None

    def calibration(self, backend: str) -> BackendCalibration | None:
        """The calibration tools/calibrate recorded for a runtime backend (on the device it ran on)."""
        data = self.manifest["calibration"]["backends"].get(backend)
        try:
            return BackendCalibration.from_dict(data) if data else None
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{self.path / MANIFEST}: the calibration recorded for {backend} is not one this "
                                f"streamfuse reads; calibrate again: python -m streamfuse.tools.calibrate --artifact "
                                f"{self.path} --backend {backend}") from None

    @property
    def drafters(self) -> dict[str, dict]:
        """method -> its drafter's entry (path, gamma, ...), for the methods other than plain and ss."""
        return self.manifest["drafters"]

    def drafter_path(self, method: str) -> Path:
        """The checked folder of a method's drafter. Raises if the artifact has none or it was altered."""
        entry = self.drafters.get(method)
        if entry is None:
            raise ArtifactError(f"{self.path} has no drafter for method {method} (it has: "
                                f"{', '.join(sorted(self.drafters)) or 'none'}); add one with export/build.py "
                                f"--set {method}.enabled=true (it reuses the SS stages)")
        folder = self.path / entry["path"]
        if not folder.is_dir() or file_digest(folder)["sha256"] != entry["sha256"]:
            raise ArtifactError(f"{folder} is missing or differs from the manifest: copy the artifact again or rebuild "
                                f"it with export/build.py --set {method}.enabled=true")
        return folder

    def record_drafter(self, method: str, entry: dict) -> None:
        self.manifest["drafters"][method] = entry
        self._write()

    def update(self, **fields) -> None:
        """Add results (the build's profile) to the manifest."""
        self.manifest.update(fields)
        self._write()

    def save_acceptance(self, acceptance: AcceptanceModel) -> None:
        """Record the acceptance model; another one than recorded drops the backends' calibrations,
        whose expected tokens came from it."""
        if self.acceptance != acceptance:
            self.manifest["calibration"] = {"acceptance": acceptance.to_dict(), "backends": {}}
            self._write()

    def save_calibration(self, backend: str, calibration: BackendCalibration) -> None:
        """Record a backend's calibration in the manifest."""
        self.manifest["calibration"]["backends"][backend] = calibration.to_dict()
        self._write()

    def _write(self) -> None:
        """An atomic rewrite of the manifest: readers never see half of one. Another task's view writes its
        own fields back under tasks."""
        stored = self.manifest
        if self.stored is not None:
            stored = self.stored
            stored[TASKS][self.task] = {name: self.manifest[name] for name in TASK_FIELDS}
        write_manifest(self.path, stored)

    def add_task(self, fields: dict) -> None:
        """Record another task (its TASK_FIELDS) on this artifact's graphs, replacing one of the same name."""
        stored = self.stored or self.manifest
        if fields["task"] == stored["task"]:
            raise ArtifactError(f"task {fields['task']} is the artifact's own: rebuild it instead of adding it")
        stored[TASKS][fields["task"]] = {name: fields[name] for name in TASK_FIELDS}
        write_manifest(self.path, stored)

    def graph_spec(self, backend: str) -> GraphSpec:
        """What the host must know to run `backend`'s graphs."""
        model, graphs = self.manifest["model"], self.manifest["graphs"]
        owner = self.manifest["kv_layout"]["owner"]
        if backend not in owner:
            raise ArtifactError(f"{self.path} has no {backend} graphs (it has {', '.join(owner)}); rebuild it with "
                                f"export/build.py --backends {backend}")
        return GraphSpec(model["num_layers"], model["num_kv_heads"], model["head_dim"], model["vocab_size"],
                         self.manifest["streams"]["num_streams"], graphs["capacity"], graphs["prefill_chunk"],
                         tuple(graphs["buckets"]), tuple(graphs["greedy_step"]["schedules"]), graphs["greedy_step"]["width"],
                         graphs["heads"]["count"], head_ids=self.head_ids(), engine_cache=owner[backend] == "engine")

    def head_ids(self) -> np.ndarray | None:
        """The token ids the LM head keeps (model.head_vocab: a draft model's pruned vocabulary), checked; None:
        the head covers the vocabulary."""
        entry = self.manifest["model"]["head_vocab"]
        if entry is None:
            return None
        file = self.path / entry["path"]
        if not file.is_file() or file_digest(file)["sha256"] != entry["sha256"]:
            raise ArtifactError(f"{file} is missing or differs from the manifest: copy the artifact again or rebuild it")
        from safetensors.numpy import load_file

        return load_file(file)["ids"]

    def backend_files(self, backend: str) -> dict[str, Path]:
        """The checked files of one backend: name -> path. Raises if missing, truncated or altered."""
        entries = self.manifest["files"].get(backend)
        if entries is None:
            built = ", ".join(sorted(self.manifest["files"])) or "none"
            raise ArtifactError(f"{self.path} has no {backend} model (built: {built}); rebuild with "
                                f"export/build.py --backends ...,{backend}")
        paths = {}
        for name, entry in entries.items():
            file = self.path / entry["path"]
            if not file.exists():
                raise ArtifactError(f"{file} is missing: the artifact is incomplete; rebuild it with export/build.py")
            found = file_digest(file)
            if found["bytes"] != entry["bytes"]:
                raise ArtifactError(f"{file} has {found['bytes']} bytes, the manifest says {entry['bytes']}: the file "
                                    f"is truncated or replaced; copy the artifact again or rebuild it")
            if found["sha256"] != entry["sha256"]:
                raise ArtifactError(f"{file} does not match its sha256 in the manifest: the file is corrupted; copy "
                                    f"the artifact again or rebuild it")
            paths[name] = file
        return paths

    def load_tokenizer(self):
        """The artifact's tokenizer (runtime/tokenizer.py, no Transformers), checked against the model's
        vocabulary and the recorded hash."""
        from streamfuse.runtime.tokenizer import Tokenizer

        info = self.manifest["tokenizer"]
        folder = self.path / info["path"]
        tokenizer = Tokenizer(folder)
        vocab = self.manifest["model"]["vocab_size"]
        if len(tokenizer) > vocab:
            raise ArtifactError(f"{folder}: tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                                f"{vocab}: this tokenizer belongs to another model; restore the artifact's tokenizer/")
        if file_digest(folder / "tokenizer.json")["sha256"] != info["sha256"]:
            raise ArtifactError(f"{folder / 'tokenizer.json'} differs from the tokenizer the model was exported with; "
                                f"restore the artifact's tokenizer/ folder or rebuild the artifact")
        return tokenizer
