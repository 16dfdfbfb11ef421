"""What the demo does, without Qt: load an artifact, run one generation through the Python API (runtime/request/api.py),
report it step by step.

The worker thread calls these; tests call them directly.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from streamfuse.apps.markup import Segment, SegmentBuilder
from streamfuse.apps.stats import RunStats
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.decode import StepEvent
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD, DEFAULT_TREE, DecodeRequest
from streamfuse.runtime.request.loader import Loaded, load

BUILD_HINT = (
    "Build one with `make build` (fine-tunes SmolLM2-135M on DialogSum and exports it: 32-89 min on 2 cores, "
    "by machine: README's set-up) or `streamfuse build --task dialogsum --preset smoke` (minutes), then open "
    "artifacts/dialogsum (every backend) or checkpoints/dialogsum-<preset>/ss (torch only)."
)


# The panes' choices before a model is loaded; once one is, those of the registry it carries drafters for.
DEFAULT_METHODS = (BASELINE_METHOD, DEFAULT_METHOD)


def method_choices(names) -> list[tuple[str, str]]:
    """(name, label) of registered methods, for a selector."""
    return [(name, registry.get(name).label) for name in names]


@dataclass(frozen=True)
class LoadRequest:
    artifact: Path
    backend: str = "torch"
    stream_schedule: str = "fused"  # a load-time choice of the backend
    device: str = "cpu"
    task: str | None = None  # one of the artifact's tasks (None: its own); switched without loading again


@dataclass(frozen=True)
class GenerationRequest:
    method: str
    text: str  # the dialogue (task source) or a plain user message
    tree: str = ""  # "gamma=G,k=K" or JSON paths; "": the artifact's tree, else DEFAULT_TREE
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0


class Cancelled(Exception):
    """Raised from the step callback to leave the decode loop between two steps."""


Update = Callable[[list[Segment], RunStats], None]


class DemoController:
    """Holds the loaded artifact; loading again with the same request reuses it."""

    def __init__(self):
        self.loaded: Loaded | None = None
        self.request: LoadRequest | None = None

    def load(self, request: LoadRequest) -> Loaded:
        """Load the request's model; another task of the loaded artifact is switched to, nothing loaded again."""
        if self.request is not None and request == dataclasses.replace(self.request, task=request.task):
            artifact = self.loaded.artifact
            own = artifact.tasks[0] if artifact is not None else self.loaded.tasks[0]
            self.loaded = self.loaded.with_task(request.task or own)
            self.request = request
        elif request != self.request:
            self.loaded, self.request = None, None  # free the old model before loading the next
            self.loaded = load(
                request.artifact, request.backend, request.device, request.stream_schedule, task=request.task
            )
            self.request = request
        return self.loaded

    def tasks(self) -> tuple[str, ...]:
        """The loaded model's tasks, the active one first."""
        return self._loaded().tasks

    def warm_up(self) -> None:
        """A few tokens per method: a fresh model's first calls are slow (allocations, lazy
        initialisation), and would otherwise be charged to whichever pane runs first."""
        loaded = self._loaded()
        streams = loaded.backend.num_streams
        # An artifact: its calibrated (or default) tree, which its graphs have; a checkpoint takes any that fits.
        tree = "" if loaded.tree is not None else f"gamma={min(3, streams)},k=2"
        for name in DEFAULT_METHODS:
            if registry.get(name).streams and not streams:
                continue  # a model without streams can still decode plainly
            self.generate(GenerationRequest(name, "Hello.", tree, max_new_tokens=4), lambda *_: None, threading.Event())

    def methods(self) -> list[tuple[str, str]]:
        """(name, label) of the methods the loaded model decodes with (the registry's, where it has drafters)."""
        return method_choices(self._loaded().methods)

    def default_tree(self) -> str:
        """What an empty tree setting means for the loaded artifact."""
        loaded = self._loaded()
        tree = loaded.tree
        if tree is None:
            return DEFAULT_TREE
        whose = "the tree calibrated for this backend" if loaded.calibration else "the artifact's tree"
        return f"{whose} ({tree.num_nodes} nodes, depth {tree.depth})"

    def describe(self) -> str:
        if self.loaded is None:
            return "no artifact"
        info, backend = self.loaded.info, self.loaded.backend
        task = info.get("task", "no task")
        preset = f", preset {info['preset']}" if "preset" in info else ""
        return (
            f"{self.request.artifact.name} ({task}{preset}): {backend.name} backend, "
            f"{backend.num_streams} streams, "
            f"{self.request.stream_schedule} streams schedule"
        )

    def decode_request(self, request: GenerationRequest) -> DecodeRequest:
        """The panes' request as the API takes it (the library's checks, its tree choice and fallback)."""
        return DecodeRequest(
            request.method,
            request.max_new_tokens,
            temperature=request.temperature,
            seed=request.seed,
            tree=request.tree or None,
        )

    def generate(self, request: GenerationRequest, on_update: Update, stop: threading.Event) -> RunStats:
        """Run one generation through the API (runtime/request/api.py's Model.run); `on_update(new_segments, stats)`
        after every model call. Setting `stop` ends it after the current step (stop_reason "stopped")."""
        loaded = self._loaded()
        if not request.text.strip():
            raise ValueError("the input is empty: paste a dialogue or pick an example")
        model = Model(loaded)
        # Task artifacts were fine-tuned on a prompt format: format the text as in training, the source
        # kept whole up to the context (as the generate CLI does without --cut-source).
        ids = model.prompt_ids(request.text, as_task=loaded.prompt is not None)
        builder = SegmentBuilder(lambda tokens: loaded.tokenizer.decode(tokens, skip_special_tokens=True))
        stats = RunStats(request.method)
        started = time.perf_counter()

        def on_step(event: StepEvent) -> None:
            stats.add(event, time.perf_counter() - started)
            on_update(builder.add(event), stats)
            if stop.is_set():
                raise Cancelled

        if stop.is_set():
            stats.stop_reason = "stopped"
            return stats
        try:
            completion = model.run(ids, self.decode_request(request), on_step=on_step)
        except Cancelled:
            stats.stop_reason = "stopped"
            return stats
        stats.finish(completion)
        return stats

    def _loaded(self) -> Loaded:
        if self.loaded is None:
            raise RuntimeError(f"no artifact is open. {BUILD_HINT}")
        return self.loaded
