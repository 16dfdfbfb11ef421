"""The exported artifact's contract: manifest.json, read and checked before anything runs.

    <artifact>/manifest.json   schema, model dims, draft trees, calibration (acceptance model; per
                               backend: step costs and the chosen tree), graphs (methods, shapes),
                               KV layout, tokenizer (each of its files' bytes + sha256), files (bytes +
                               sha256), parity, eval, versions; its declared schema: runtime/artifact/manifest_schema.py
    <artifact>/tokenizer/      the tokenizer the model was trained with
    <artifact>/head_vocab.safetensors  a draft model's artifact only: the token ids its LM head keeps
    <artifact>/adapter/        the fine-tuned checkpoint (LoRA + streams): the torch backend's input,
                               and what other tasks on the same base share
    <artifact>/drafters/<m>/   method m's drafter (sd: the draft model checkpoint, run on torch; medusa:
                               its heads, also in the graphs' heads method, graphs.heads)
    <artifact>/model.pte       ExecuTorch (XNNPACK), methods prefill/decode/streams, step_T/greedy_step_T per size
                               bucket T, the tree an input (and heads), batch_step_BxT per graphs.batches
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

Before anything is used, the manifest is checked against its declared schema (runtime/artifact/manifest_schema.py);
every path it names is confined to the artifact folder, and every file that changes behaviour is hashed before it is
parsed (runtime/artifact/files.py). Writes take the artifact's lock (LOCK) and re-read the manifest under it, so
two writers (two tools.calibrate runs, a build's swap) each keep the other's change; the file is replaced through
a temporary file of its own (runtime/artifact/durable.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamfuse.runtime.artifact import manifest_schema
from streamfuse.runtime.artifact.contract import ENGINE_CACHE, GraphSpec
from streamfuse.runtime.artifact.durable import locked, write_atomic
from streamfuse.runtime.artifact.files import ArtifactError, file_digest, folder_files, inside, mismatch, read_checked
from streamfuse.runtime.speculation.calibration import AcceptanceModel, BackendCalibration
from streamfuse.runtime.speculation.tree import TreeSpec

__all__ = ["ArtifactError", "file_digest"]  # re-exported: the artifact's error and digest live in artifact_files

SCHEMA = "streamfuse.artifact/23"  # /23: streamfuse.Q4Linear takes rank_splits (each packed sibling its own LoRA)
MANIFEST = "manifest.json"
LOCK = ".manifest.lock"  # every write to the artifact holds this file's lock (runtime/artifact/durable.py)
MAX_MANIFEST_BYTES = 1 << 26  # a real manifest is well under 1 MiB
HEAD_VOCAB = "head_vocab.safetensors"  # "ids": the LM head's kept token ids, ascending (int64)
DRAFT_VOCAB = "draft_vocab.safetensors"  # "ids": greedy_step's draft vocabulary, ascending (int64)
TASKS = "tasks"  # <artifact>/tasks/<task>/: a task's tensor files (and an added task's adapter/)
# What each task has of its own; the rest (graphs, files, model, tokenizer, streams' shape) is the base's.
TASK_FIELDS = tuple(manifest_schema.TASK.fields)
REBUILD = "rebuild the artifact with this streamfuse (streamfuse build)"
COPY_AGAIN = "copy the artifact again or rebuild it with streamfuse build"


def save_vocab(path: Path, ids) -> None:
    from safetensors.numpy import save_file

    save_file({"ids": np.asarray(ids, dtype=np.int64)}, str(path))


def task_names(manifest: dict) -> tuple[str, ...]:
    return (manifest["task"], *manifest[TASKS])


def parse_manifest(data: bytes, file: Path) -> dict:
    """The manifest in `data` (read from `file`), checked against the schema: an ArtifactError otherwise, one line
    naming the key and the fix. Nothing else escapes, whatever the bytes (tests/fuzz/manifest)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(
            f"{file} has {len(data)} bytes, more than a manifest holds ({MAX_MANIFEST_BYTES}); {REBUILD}"
        )
    try:
        manifest = json.loads(data.decode("utf-8"))
        json.dumps(manifest, ensure_ascii=False).encode("utf-8")  # a lone surrogate (\\ud800) anywhere
    except UnicodeError as error:
        raise ArtifactError(f"{file} is not valid UTF-8 text ({error.reason} at {error.start}); {REBUILD}") from None
    except RecursionError:
        raise ArtifactError(f"{file} nests its values too deeply to be a manifest; {REBUILD}") from None
    except ValueError as error:  # JSONDecodeError, an integer of too many digits
        raise ArtifactError(f"{file} is not valid JSON ({str(error).splitlines()[0]}); {REBUILD}") from None
    check_manifest(manifest, file)
    return manifest


def check_manifest(manifest: object, file: Path) -> None:
    """ArtifactError unless `manifest` has this streamfuse's schema and every key it declares, well typed."""
    schema = manifest.get("schema") if isinstance(manifest, dict) else None
    if schema != SCHEMA:
        raise ArtifactError(
            f"{file} has schema {manifest_schema.show(schema)}; this streamfuse reads {SCHEMA!r}: "
            f"rebuild the artifact with this version (streamfuse build)"
        )
    try:
        manifest_schema.check(manifest)
    except manifest_schema.SchemaError as error:
        raise ArtifactError(f"{file}: {error}; {REBUILD}") from None
    for task in (manifest, *manifest[TASKS].values()):
        _check_task_data(task, "" if task is manifest else f"tasks.{task['task']}.", file)


def _check_task_data(task: dict, where: str, file: Path) -> None:
    """What the schema's types leave open: each tree is a tree, the acceptance model replays answers."""
    for index, tree in enumerate(task["trees"]):
        try:
            TreeSpec.from_dict(tree)
        except ValueError as error:
            raise ArtifactError(f"{file}: {where}trees[{index}] is not a draft tree ({error}); {REBUILD}") from None
    acceptance = task["calibration"]["acceptance"]
    if acceptance is not None:
        positions = sum(len(rows) for rows in acceptance["answers"])
        if positions == 0 or positions != acceptance["positions"]:
            raise ArtifactError(
                f"{file}: {where}calibration.acceptance.positions is {acceptance['positions']}, its "
                f"answers hold {positions} (at least 1); {REBUILD}"
            )


def read_manifest(folder: Path) -> dict:
    file = Path(folder) / MANIFEST
    if not file.is_file():
        raise ArtifactError(
            f"{file} not found: {folder} is not an exported artifact (build one with "
            f"`streamfuse build --task dialogsum`)"
        )
    inside(folder, MANIFEST)
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ArtifactError(
            f"{file} cannot be read ({error.strerror or error.__class__.__name__}); check its "
            f"permissions or copy the artifact again"
        ) from None
    return parse_manifest(data, file)


def write_manifest(folder: Path, manifest: dict) -> None:
    """Check and write a manifest whole (a temporary file of this call's own, fsynced, renamed); the caller holds
    the artifact's lock where another writer could be at work."""
    check_manifest(manifest, Path(folder) / MANIFEST)
    write_atomic(Path(folder) / MANIFEST, json.dumps(manifest, indent=2).encode())


def lock(folder: Path):
    """The artifact's write lock (a context manager), held while its manifest is read, changed and written, and
    while a build swaps the folder."""
    return locked(Path(folder) / LOCK)


@dataclass
class Artifact:
    """An artifact as one of its tasks sees it: `manifest` is the top level with that task's fields over it."""

    path: Path
    manifest: dict
    stored: dict | None = None  # the manifest as written (None: `manifest` is the artifact's own task's)
    built: str = field(default="", init=False)  # the build that made these files (its build_key)

    def __post_init__(self):
        self.built = (self.stored or self.manifest)["build_key"]

    @classmethod
    def open(cls, path: Path, task: str | None = None) -> Artifact:
        """task: one of `tasks` (default: the artifact's own)."""
        path = Path(path)
        return cls.view(path, read_manifest(path), task)

    @classmethod
    def view(cls, path: Path, manifest: dict, task: str | None) -> Artifact:
        if task is None or task == manifest["task"]:
            return cls(path, manifest)
        if task not in manifest[TASKS]:
            raise ArtifactError(
                f"{path} has no task {task!r} (its tasks: {', '.join(task_names(manifest))}); add it "
                f"with streamfuse build --task {task} --out {path}"
            )
        return cls(path, {**manifest, **manifest[TASKS][task]}, manifest)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The artifact's tasks, its own first."""
        return task_names(self.stored or self.manifest)

    @property
    def task(self) -> str:
        return self.manifest["task"]

    def for_task(self, task: str) -> Artifact:
        return Artifact.open(self.path, task)

    def file(self, relative: str) -> Path:
        """A path the manifest names, confined to the artifact folder."""
        return inside(self.path, relative)

    def checked(self, entry: dict, fix: str) -> Path:
        """The file or folder of a manifest entry (path, bytes, sha256), once it matches; else one line ending in
        `fix`."""
        path = self.file(entry["path"])
        problem = mismatch(path, entry, self.path)
        if problem is not None:
            raise ArtifactError(f"{path} {problem}; {fix}")
        return path

    def _vocab(self, entry: dict) -> np.ndarray:
        from safetensors.numpy import load

        path = self.file(entry["path"])
        data = read_checked(path, entry, COPY_AGAIN)
        try:
            ids = load(data)["ids"]
        except Exception as error:  # safetensors' own error types; the bytes are the build's
            raise ArtifactError(f"{path} is not a token id file ({error.__class__.__name__}); {REBUILD}") from None
        return ids

    def task_tensors(self, backend: str) -> dict[str, np.ndarray] | None:
        """The task's tensors for `backend`'s graphs by input name (None: its graphs hold them), checked
        against the manifest before they are parsed."""
        entry = self.manifest["task_files"].get(backend)
        if entry is None:
            return None
        from safetensors.numpy import load

        path = self.file(entry["path"])
        fix = f"copy the artifact again or rebuild the task with streamfuse build --task {self.task} --out {self.path}"
        try:
            data = read_checked(path, entry, fix)
        except ArtifactError:
            raise ArtifactError(
                f"{path}: task {self.task}'s tensors for {backend} are missing or differ from the manifest; {fix}"
            ) from None
        return load(data)

    def draft_ids(self) -> np.ndarray | None:
        """greedy_step's draft vocabulary (None: the streams rank every token), checked."""
        entry = self.manifest["graphs"]["greedy_step"]["draft_vocab"]
        return None if entry is None else self._vocab(entry)

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
            if data:
                manifest_schema.BACKEND_CALIBRATION.check(data, f"calibration.backends.{backend}")
            return BackendCalibration.from_dict(data) if data else None
        except ValueError:  # SchemaError, or a tree that is none
            raise ArtifactError(
                f"{self.path / MANIFEST}: the calibration recorded for {backend} is not one this "
                f"streamfuse reads; calibrate again: python -m streamfuse.tools.calibrate --artifact "
                f"{self.path} --backend {backend}"
            ) from None

    @property
    def drafters(self) -> dict[str, dict]:
        """method -> its drafter's entry (path, gamma, ...), for the methods other than plain and ss."""
        return self.manifest["drafters"]

    def drafter_path(self, method: str) -> Path:
        """The checked folder of a method's drafter. Raises if the artifact has none or it was altered."""
        entry = self.drafters.get(method)
        if entry is None:
            raise ArtifactError(
                f"{self.path} has no drafter for method {method} (it has: "
                f"{', '.join(sorted(self.drafters)) or 'none'}); add one with streamfuse build "
                f"--set {method}.enabled=true (it reuses the SS stages)"
            )
        folder = self.file(entry["path"])
        if not folder.is_dir() or mismatch(folder, entry, self.path) is not None:
            raise ArtifactError(
                f"{folder} is missing or differs from the manifest: copy the artifact again or rebuild "
                f"it with streamfuse build --set {method}.enabled=true"
            )
        return folder

    def adapter_path(self) -> Path:
        """The checked checkpoint folder the torch backend loads (the task's adapter/)."""
        return self.checked(self.manifest["adapter"], COPY_AGAIN)

    # --- writes: under the artifact's lock, on the manifest as stored now -----------------------
    def _change(self, change: Callable[[dict, dict], None]) -> None:
        """Apply change(stored manifest, this task's record in it) to the manifest as written now, under the lock:
        another writer's changes since this one opened stay. Refused where the artifact was rebuilt meanwhile
        (what this writer measured belongs to the old files)."""
        with lock(self.path):
            stored = read_manifest(self.path)
            if stored["build_key"] != self.built:
                raise ArtifactError(
                    f"{self.path} was rebuilt (build {stored['build_key']}) since this process opened "
                    f"build {self.built}; run it again on the new artifact"
                )
            if self.task != stored["task"] and self.task not in stored[TASKS]:
                raise ArtifactError(
                    f"{self.path} no longer has task {self.task}; add it again with streamfuse build "
                    f"--task {self.task} --out {self.path}"
                )
            change(stored, stored if self.task == stored["task"] else stored[TASKS][self.task])
            write_manifest(self.path, stored)
        fresh = Artifact.view(self.path, stored, self.task if self.stored is not None else None)
        self.manifest, self.stored = fresh.manifest, fresh.stored

    def record_drafter(self, method: str, entry: dict) -> None:
        self._change(lambda _, record: record["drafters"].__setitem__(method, entry))

    def update(self, **fields) -> None:
        """Add results (the build's profile) to this task's record in the manifest."""
        unknown = set(fields) - set(TASK_FIELDS)
        if unknown:
            raise ValueError(f"Artifact.update takes a task's fields ({', '.join(TASK_FIELDS)}), not {sorted(unknown)}")
        self._change(lambda _, record: record.update(fields))

    def save_acceptance(self, acceptance: AcceptanceModel) -> None:
        """Record the acceptance model; another one than recorded drops the backends' calibrations,
        whose expected tokens came from it."""

        def change(_, record: dict) -> None:
            recorded = record["calibration"]["acceptance"]
            if recorded is None or AcceptanceModel.from_dict(recorded) != acceptance:
                record["calibration"] = {"acceptance": acceptance.to_dict(), "backends": {}}

        self._change(change)

    def save_calibration(self, backend: str, calibration: BackendCalibration) -> None:
        """Record a backend's calibration; refused where the acceptance model it was computed with was replaced."""
        measured_with = self.manifest["calibration"]["acceptance"]

        def change(_, record: dict) -> None:
            if record["calibration"]["acceptance"] != measured_with:
                raise ArtifactError(
                    f"{self.path}: the acceptance model changed while {backend} was calibrated; "
                    f"calibrate again: python -m streamfuse.tools.calibrate --artifact {self.path} "
                    f"--backend {backend}"
                )
            record["calibration"]["backends"][backend] = calibration.to_dict()

        self._change(change)

    def add_task(self, fields: dict) -> None:
        """Record another task (its TASK_FIELDS) on this artifact's graphs, replacing one of the same name."""
        if fields["task"] == (self.stored or self.manifest)["task"]:
            raise ArtifactError(f"task {fields['task']} is the artifact's own: rebuild it instead of adding it")
        self._change(lambda stored, _: stored[TASKS].__setitem__(fields["task"], {n: fields[n] for n in TASK_FIELDS}))

    def graph_spec(self, backend: str) -> GraphSpec:
        """What the host must know to run `backend`'s graphs."""
        model, graphs = self.manifest["model"], self.manifest["graphs"]
        owner = self.manifest["kv_layout"]["owner"]
        if backend not in owner:
            raise ArtifactError(
                f"{self.path} has no {backend} graphs (it has {', '.join(owner)}); rebuild it with "
                f"streamfuse build --backends {backend}"
            )
        return GraphSpec(
            model["num_layers"],
            model["num_kv_heads"],
            model["head_dim"],
            model["vocab_size"],
            self.manifest["streams"]["num_streams"],
            graphs["capacity"],
            graphs["prefill_chunk"],
            tuple(graphs["buckets"]),
            tuple(graphs["greedy_step"]["schedules"]),
            graphs["greedy_step"]["width"],
            graphs["heads"]["count"],
            head_ids=self.head_ids(),
            engine_cache=owner[backend] == ENGINE_CACHE,
            batches=tuple((count, rows) for count, rows in graphs["batches"]) if owner[backend] == ENGINE_CACHE else (),
        )

    def head_ids(self) -> np.ndarray | None:
        """The token ids the LM head keeps (model.head_vocab: a draft model's pruned vocabulary), checked; None:
        the head covers the vocabulary."""
        entry = self.manifest["model"]["head_vocab"]
        return None if entry is None else self._vocab(entry)

    def backend_files(self, backend: str) -> dict[str, Path]:
        """The checked files of one backend: name -> path. Raises if missing, truncated or altered."""
        entries = self.manifest["files"].get(backend)
        if entries is None:
            built = ", ".join(sorted(self.manifest["files"])) or "none"
            raise ArtifactError(
                f"{self.path} has no {backend} model (built: {built}); rebuild with "
                f"streamfuse build --backends ...,{backend}"
            )
        paths = {}
        for name, entry in entries.items():
            file = self.file(entry["path"])
            problem = mismatch(file, entry, self.path)
            if problem == "is missing":
                raise ArtifactError(f"{file} is missing: the artifact is incomplete; rebuild it with streamfuse build")
            if problem is not None and problem.startswith("has "):
                raise ArtifactError(
                    f"{file} {problem}: the file is truncated or replaced; copy the artifact again or rebuild it"
                )
            if problem is not None:
                raise ArtifactError(f"{file} {problem}: the file is corrupted; copy the artifact again or rebuild it")
            paths[name] = file
        if backend == "onnxruntime":  # the model names its weights file: one of the checked files, nothing else
            from streamfuse.runtime.artifact.onnx_external import check_external_data

            unlisted = check_external_data(paths["model"]) - set(paths.values())
            if unlisted:
                raise ArtifactError(
                    f"{paths['model']} reads {sorted(unlisted)[0]}, which the manifest does not list; {REBUILD}"
                )
        return paths

    def load_tokenizer(self):
        """The artifact's tokenizer (runtime/artifact/tokenizer.py, no Transformers): every file of its folder checked
        against the manifest before any is parsed, then checked against the model's vocabulary."""
        from streamfuse.runtime.artifact.tokenizer import Tokenizer

        info = self.manifest["tokenizer"]
        folder = self.file(info["path"])
        files = self._tokenizer_files(folder, info["files"])
        tokenizer = Tokenizer(folder, files)
        vocab = self.manifest["model"]["vocab_size"]
        if len(tokenizer) > vocab:
            raise ArtifactError(
                f"{folder}: tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                f"{vocab}: this tokenizer belongs to another model; restore the artifact's tokenizer/"
            )
        return tokenizer

    def _tokenizer_files(self, folder: Path, listed: dict) -> dict[str, bytes]:
        fix = "restore the artifact's tokenizer/ folder or rebuild the artifact"
        if not folder.is_dir():
            raise ArtifactError(f"{folder} is missing; {fix}")
        found = {file.relative_to(folder).as_posix() for file in folder_files(folder, self.path)}
        if found != set(listed):
            extra, missing = sorted(found - set(listed)), sorted(set(listed) - found)
            problems = ([f"has files the manifest does not list: {', '.join(extra)}"] if extra else []) + (
                [f"lacks {', '.join(missing)}"] if missing else []
            )
            raise ArtifactError(f"{folder} {' and '.join(problems)} (each changes how text becomes ids); {fix}")
        files = {}
        for name, entry in listed.items():
            try:
                files[name] = read_checked(folder / name, entry, fix)
            except ArtifactError:
                raise ArtifactError(
                    f"{folder / name} differs from the tokenizer the model was exported with; {fix}"
                ) from None
        return files
