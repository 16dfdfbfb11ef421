"""The worker thread: model loads and generations run here, so the window never freezes.

Requests reach the worker through queued signals, so they run one after the other in the
order they were made; that is also how "run both" keeps the two timings undisturbed.
"""

from __future__ import annotations

import dataclasses
import threading

from PySide6.QtCore import QObject, QThread, Signal, Slot

from streamfuse.apps.demo_controller import DemoController, GenerationRequest, LoadRequest
from streamfuse.apps.markup import Segment
from streamfuse.apps.stats import RunStats


class Worker(QObject):
    """Lives in the worker thread; every slot reports back through a signal, never raises."""

    loaded = Signal(str, str, object)  # the loaded artifact's description, what an empty tree means, its methods
    load_failed = Signal(str)
    started = Signal(int)  # pane
    progressed = Signal(int, object, object)  # pane, list[Segment], RunStats snapshot
    finished = Signal(int, object)  # pane, RunStats
    failed = Signal(int, str)  # pane, message

    def __init__(self, controller: DemoController):
        super().__init__()
        self.controller = controller

    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        try:
            self.controller.load(request)
            self.controller.warm_up()
        except Exception as error:  # shown in the window: a bad folder must not end the app
            self.load_failed.emit(f"Could not load {request.artifact}: {error}")
            return
        self.loaded.emit(self.controller.describe(), self.controller.default_tree(), self.controller.methods())

    @Slot(int, object, object)
    def generate(self, pane: int, request: GenerationRequest, stop: threading.Event) -> None:
        self.started.emit(pane)

        def update(segments: list[Segment], stats: RunStats) -> None:
            self.progressed.emit(pane, segments, dataclasses.replace(stats))  # a copy: the loop goes on mutating

        try:
            stats = self.controller.generate(request, update, stop)
        except Exception as error:  # bad tree, prompt too long, ...: reported in the pane
            self.failed.emit(pane, str(error))
            return
        self.finished.emit(pane, stats)


class WorkerThread(QObject):
    """Owns the worker thread; the window talks to the worker only through these signals."""

    load_requested = Signal(object)
    generate_requested = Signal(int, object, object)

    def __init__(self, controller: DemoController | None = None):
        super().__init__()
        self.thread = QThread()
        self.thread.setObjectName("streamfuse-worker")
        self.worker = Worker(controller or DemoController())
        self.worker.moveToThread(self.thread)
        self.load_requested.connect(self.worker.load)
        self.generate_requested.connect(self.worker.generate)
        self.thread.start()

    def shutdown(self) -> None:
        """Let the current request finish (callers set its stop event first), then end the thread."""
        self.thread.quit()
        self.thread.wait()
