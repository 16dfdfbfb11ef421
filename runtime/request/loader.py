"""Artifact folder -> backend, tokenizer and what the runtime must know about the model.

Two kinds of folder load:
- an exported artifact (manifest.json; streamfuse build --backends ...): any backend it was built
  for, plus torch from its adapter/ folder;
- a fine-tuned checkpoint (streamfuse.json; the train stage's output): the torch backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from pathlib import Path

from streamfuse.runtime.artifact.format import MANIFEST, Artifact, ArtifactError
from streamfuse.runtime.artifact.prompt import PromptFormat
from streamfuse.runtime.backends.base import Backend
from streamfuse.runtime.backends.runners import MissingBackend, open_runner
from streamfuse.runtime.backends.static_graph import StaticGraphBackend
from streamfuse.runtime.methods import registry as methods
from streamfuse.runtime.request.drafter import Drafter
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.calibration import BackendCalibration
from streamfuse.runtime.speculation.fallback import FallbackConfig
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.runtime.speculation.tree_choice import TreeChoice

# the engines load() opens; the same names key an artifact's files (streamfuse build --backends)
BACKENDS = ("torch", "executorch", "onnxruntime", "coreml")
EXPORTED_BACKENDS = BACKENDS[1:]  # those that run an artifact's exported graphs

# Without calibrations, the order measured on CPUs (docs/benchmarks.md): XNNPACK, then ONNX Runtime, then torch.
PREFERENCE = ("coreml", "executorch", "onnxruntime", "torch")
TYPICAL_ANSWER_TOKENS = 64  # a request's length where the artifact has no acceptance model to say
BACKEND_ENTRY_POINTS = "streamfuse.backends"  # pyproject.toml's group: backend name -> its opener


@dataclass(frozen=True)
class Loaded:
    """A loaded model: its backend and tokenizer, and the artifact its methods' drafters come from."""

    backend: Backend
    tokenizer: object
    info: dict  # the checkpoint's training info (task, preset, ...)
    prompt: PromptFormat | None  # the task's prompt format, when the model was fine-tuned on one
    engine: str = "torch"  # the backend's name in BACKENDS
    artifact: Artifact | None = None  # where the other methods' drafters are (None: a bare checkpoint)
    calibration: BackendCalibration | None = None  # this backend's, from the artifact (tools/calibrate.py)
    threads: int | None = None  # the engine's threads, as loaded
    resources: dict = field(default_factory=dict, compare=False, repr=False)  # what methods load once (cached)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this model serves (an artifact's; a bare checkpoint's one), the loaded one first."""
        if self.artifact is None:
            return (self.info.get("task"),)
        return (self.artifact.task, *(t for t in self.artifact.tasks if t != self.artifact.task))

    def with_task(self, task: str) -> Loaded:
        """The same engine serving another of the artifact's tasks, nothing loaded again: on graphs that take the
        task's tensors, its tensors are bound in place of the loaded task's; on torch, its peft adapter and streams
        are made active (TaskSet). Use the returned model: the engine now runs `task`, this one's task no longer."""
        if self.artifact is None or task == self.artifact.task:
            if task != self.tasks[0]:
                raise ValueError(f"task {task!r}: this model serves {self.tasks[0]} only")
            return self
        view = self.artifact.for_task(task)
        if self.engine == "torch":
            self.backend.use_task(task)
        else:
            tensors = view.task_tensors(self.engine)
            if tensors is None:
                raise ValueError(
                    f"{view.path}: the {self.engine} graphs hold task {self.artifact.task}'s weights, so "
                    f"they cannot run {task}; build the tasks together (streamfuse build --task "
                    f"{self.artifact.task},{task})"
                )
            self.backend.runner.bind_task(tensors)
        calibration = view.calibration(self.engine) if self.calibration is not None else None
        return Loaded(
            with_calibration(self.backend, calibration),
            self.tokenizer,
            {"task": task, **view.manifest.get("info", {})},
            _prompt(view.manifest.get("prompt")),
            self.engine,
            view,
            calibration,
            self.threads,
        )

    def with_own_cache(self) -> Loaded:
        """The same model on a backend with a KV cache of its own (StaticGraphBackend.with_own_cache): a sequence
        of a batch, or a conversation, decodes on it beside others. Its resources start empty, so a method with a
        model of its own (a draft model, with its own cache) loads one for this cache."""
        return replace(self, backend=self.backend.with_own_cache(), resources={})

    @property
    def loader(self) -> Callable[..., Loaded]:
        """This module's `load` (module-level, so a worker process can be handed it): a method opens its drafter's
        folder with it."""
        return load

    def engine_for(self, folder: Path) -> str:
        """The engine a drafter folder's model runs on: the target's, where the build exported it for that engine
        and it runs here, else torch."""
        return self.engine if self.engine in runnable_backends(folder) else "torch"

    def cached(self, key: str, make: Callable[[], object]):
        """A method's resource (a draft engine, a head), made on first use and kept with this model."""
        if key not in self.resources:
            self.resources[key] = make()
        return self.resources[key]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    @property
    def default_tree(self) -> TreeSpec | None:
        """An exported artifact's default tree (its manifest's first)."""
        return self.artifact.tree if self.artifact is not None else None

    @property
    def max_nodes(self) -> int | None:
        """The largest tree the backend runs (its largest step graph); None: any (torch)."""
        spec = getattr(self.backend, "spec", None)
        return spec.max_nodes if spec is not None else None

    @property
    def tree(self) -> TreeSpec | None:
        """The tree to decode with: the calibrated choice for this backend, else the artifact's default."""
        if self.calibration is not None:
            return self.calibration.tree
        return self.default_tree

    def check_tree(self, tree: TreeSpec) -> None:
        """ValueError naming the largest tree the backend's graphs take, unless it can run `tree`."""
        if self.max_nodes is not None:
            self.backend.spec.bucket(tree)

    def check_method_tree(self, method: str, tree: TreeSpec) -> None:
        """check_tree for every shape the method verifies (specdec++: chains of 2 drafts up to `tree`'s)."""
        for shape in methods.get(method).shapes(tree):
            self.check_tree(shape)

    @property
    def methods(self) -> tuple[str, ...]:
        """The registered methods this model can decode with: those whose drafters it carries."""
        drafters = self.artifact.drafters if self.artifact is not None else {}
        return tuple(
            name for name in methods.names() if all(entry in drafters for entry in methods.get(name).artifact_entries)
        )

    def method_tree(self, method: str) -> TreeSpec | None:
        """The draft shape a method uses unless told otherwise (ss: the calibrated tree; sd: the chain the build
        recorded; ...; None for plain decoding). `method` is one this model carries (runtime/request/checks.py's
        check_method)."""
        return methods.get(method).default_tree(self)

    def tree_choice(self, max_nodes: int | None = None) -> TreeChoice:
        """ss-adaptive's candidates: the trees calibrated on this backend that it runs, up to max_nodes."""

        def make() -> TreeChoice:
            acceptance = self.artifact.acceptance
            if self.calibration is None or acceptance is None:
                raise ValueError(
                    f"method ss-adaptive chooses among calibrated trees, and {self.artifact.path} has no "
                    f"calibration for {self.engine}: run python -m streamfuse.tools.calibrate --artifact "
                    f"{self.artifact.path} --backend {self.engine}"
                )
            limit = min((n for n in (max_nodes, self.max_nodes) if n is not None), default=None)
            return TreeChoice.from_calibration(acceptance, self.calibration, max_nodes=limit)

        return self.cached(f"tree-choice:{max_nodes}", make)

    def drafter(self, settings: DecodeSettings) -> Drafter:
        """settings.method's drafter for the decode loop, built by its registry entry (runtime/methods); settings
        from runtime/request/checks.py's decode_settings (the method checked there)."""
        return methods.get(settings.method).drafter(self, settings)

    def fallback(self, tree: TreeSpec) -> FallbackConfig | None:
        """Plain decoding where `tree` does not pay: needs its step cost, measured by calibration; every
        calibrated tree's cost comes along for a method that changes trees per step (ss-adaptive)."""
        cost = self.calibration.step_cost(tree) if self.calibration is not None else None
        if cost is None:
            return None
        costs = tuple((c.tree.paths, c.step_seconds / self.calibration.plain_seconds) for c in self.calibration.trees)
        return FallbackConfig(cost, costs)


def runnable_backends(artifact: Path) -> list[str]:
    """The backends an artifact (or a checkpoint: torch) has files for that can run on this machine."""
    import platform

    if not (Path(artifact) / MANIFEST).is_file():
        return ["torch"]
    files = Artifact.open(artifact).manifest["files"]
    return [b for b in BACKENDS if b == "torch" or (b in files and (b != "coreml" or platform.system() == "Darwin"))]


def artifact_tasks(folder: Path) -> tuple[str, ...]:
    """The tasks an artifact serves, its own first; none for a checkpoint or a folder that does not load (loading
    it says why)."""
    try:
        return Artifact.open(folder).tasks if (Path(folder) / MANIFEST).is_file() else ()
    except ArtifactError:
        return ()


def fastest_backend(artifact: Path, task: str | None = None) -> str:
    """The runnable backend that the artifact's calibrations say answers a typical request soonest (the
    validation answers' mean length, after a prompt of the timed inputs' length), else the first of
    PREFERENCE it has (calibrations of `task`, default the artifact's own). A folder that is not a loadable artifact
    gives torch: loading it says what is wrong."""
    try:
        runnable = runnable_backends(artifact)
        if runnable == ["torch"]:
            return "torch"
        opened = Artifact.open(artifact, task)
        acceptance = opened.acceptance
        answer = 1 + acceptance.positions / len(acceptance.answers) if acceptance else TYPICAL_ANSWER_TOKENS
        seconds = {b: c.request_seconds(answer) for b in runnable if (c := opened.calibration(b))}
    except ArtifactError:
        return "torch"
    if seconds:
        return min(seconds, key=seconds.get)
    return next(b for b in PREFERENCE if b in runnable)


def load(
    artifact: Path,
    backend: str = "torch",
    device: str = "cpu",
    stream_schedule: str = "fused",
    threads: int | None = None,
    calibrated: bool = True,
    task: str | None = None,
) -> Loaded:
    """calibrated False: leave the artifact's calibration out (tools/calibrate.py measures afresh). task: one of the
    artifact's tasks (default: its own; Loaded.with_task switches later)."""
    artifact = Path(artifact)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available; choose one of {', '.join(BACKENDS)}")
    if not artifact.is_dir():
        raise FileNotFoundError(
            f"{artifact} is not a folder: pass an artifact or checkpoint made by streamfuse build "
            f"(e.g. artifacts/dialogsum or checkpoints/dialogsum-cpu/ss)"
        )
    if (artifact / MANIFEST).is_file():
        return _load_artifact(Artifact.open(artifact, task), backend, device, stream_schedule, threads, calibrated)
    if not (artifact / "streamfuse.json").is_file():
        raise FileNotFoundError(
            f"{artifact} has neither manifest.json (an exported artifact) nor streamfuse.json (a "
            f"checkpoint): build one with `streamfuse build --task dialogsum`"
        )
    if backend != "torch":
        raise ValueError(
            f"{artifact} is a checkpoint, which only the torch backend runs; export it for {backend} "
            f"with `streamfuse build --backends {backend}` and pass the artifact"
        )
    loaded = _load_checkpoint(artifact, device, stream_schedule)
    if task is not None and task != loaded.info.get("task"):
        raise ValueError(f"{artifact} is a checkpoint of task {loaded.info.get('task')}, not {task}")
    return loaded


def _load_checkpoint(
    folder: Path, device: str, stream_schedule: str, artifact: Artifact | None = None, calibrated: bool = True
) -> Loaded:
    backend, tokenizer, manifest = open_backend("torch")(folder, device, stream_schedule, artifact)
    calibration = artifact.calibration("torch") if artifact is not None and calibrated else None
    return Loaded(
        with_calibration(backend, calibration),
        tokenizer,
        manifest["info"],
        _prompt(manifest["info"].get("prompt")),
        "torch",
        artifact,
        calibration,
    )


def open_backend(name: str) -> Callable:
    """The opener an installed package registers for backend `name` (an entry point of group BACKEND_ENTRY_POINTS:
    the torch backend is export/eager.py's open_checkpoint), so the runtime reaches torch code by no import
    statement. MissingBackend (one line) where it is not registered or its packages are not installed."""
    found = entry_points(group=BACKEND_ENTRY_POINTS, name=name)
    if not found:
        raise MissingBackend(
            f"the {name} backend is not registered (no entry point {name!r} in group "
            f"{BACKEND_ENTRY_POINTS}): install it with `pip install 'streamfuse[{name}]'` (in a "
            f"checkout: `pip install -e '.[{name}]'`)"
        )
    entry = next(iter(found))
    try:
        return entry.load()
    except ImportError as error:
        raise MissingBackend(
            f"the {name} backend ({entry.value}) cannot be imported ({error}); install it with "
            f"`pip install 'streamfuse[{name}]'`"
        ) from None


def _prompt(data: dict | None) -> PromptFormat | None:
    return PromptFormat.from_dict(data) if data else None


def _load_artifact(
    artifact: Artifact, backend: str, device: str, stream_schedule: str, threads: int | None, calibrated: bool
) -> Loaded:
    if backend == "torch":
        return _load_checkpoint(artifact.adapter_path(), device, stream_schedule, artifact, calibrated)
    runner = open_runner(backend, artifact.backend_files(backend), threads)
    tensors = artifact.task_tensors(backend)
    if tensors is not None:  # the graphs hold the base only: the task's tensors are bound to every call
        runner.bind_task(tensors)
    manifest = artifact.manifest
    calibration = artifact.calibration(backend) if calibrated else None
    return Loaded(
        with_calibration(StaticGraphBackend.checked(runner, artifact.graph_spec(backend), device), calibration),
        artifact.load_tokenizer(),
        {"task": manifest.get("task"), **manifest.get("info", {})},
        _prompt(manifest.get("prompt")),
        backend,
        artifact,
        calibration,
        threads,
    )


def with_calibration(backend: StaticGraphBackend, calibration: BackendCalibration | None) -> StaticGraphBackend:
    """The backend running greedy steps the way its calibration timed faster on this device (none: one call)."""
    backend.use_two_calls(calibration.two_call_trees() if calibration is not None else ())
    return backend
