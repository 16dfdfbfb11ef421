"""The main window: artifact and decoding settings, the input dialogue, and two output panes."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMainWindow,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from streamfuse.apps.demo_controller import BUILD_HINT, DEFAULT_METHODS, GenerationRequest, LoadRequest
from streamfuse.apps.examples import Example
from streamfuse.apps.panes import RunPane, legend_html
from streamfuse.apps.stats import RunStats, comparison
from streamfuse.apps.worker import WorkerThread
from streamfuse.runtime.artifact.contract import STREAM_SCHEDULES
from streamfuse.runtime.request.frontend import DEFAULT_TREE
from streamfuse.runtime.request.loader import BACKENDS, artifact_tasks, fastest_backend

SEQUENTIAL_NOTE = (
    "Both panes run one after the other on the same input: run at once, they would share "
    "the CPU cores and disturb each other's timings."
)


@dataclass(frozen=True)
class WindowOptions:
    artifact: Path | None = None
    backend: str = "torch"
    stream_schedule: str = "fused"
    max_new_tokens: int = 128
    examples: tuple[Example, ...] = ()
    example_index: int = 0


class MainWindow(QMainWindow):
    load_done = Signal(bool)  # True: the artifact loaded
    runs_done = Signal()  # every queued generation has ended

    def __init__(self, worker_thread: WorkerThread, options: WindowOptions = WindowOptions()):
        super().__init__()
        self.worker_thread = worker_thread
        self.examples = options.examples
        self.artifact: Path | None = None
        self.loading = False
        self.ready = False  # a model is loaded and warmed up
        self.stops: dict[int, threading.Event] = {}  # pane -> stop event of its queued/running generation
        self.outcomes: dict[int, RunStats | str] = {}  # pane -> its last run's figures, or what went wrong
        self.batch: list[int] = []  # the panes of the last Run click: only they are compared
        self.setWindowTitle("streamfuse demo: Speculative Streaming")
        self.resize(1200, 820)
        self._build(options)
        self._connect_worker()
        if options.artifact is not None:
            self.open_artifact(options.artifact, options.backend)
        else:
            self._show_build_hint()

    # --- layout ---------------------------------------------------------------------------
    def _build(self, options: WindowOptions) -> None:
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.setStyleSheet("background:#fee2e2; color:#991b1b; padding:6px; border-radius:4px;")
        self.banner.hide()
        self.panes = tuple(RunPane(method) for method in DEFAULT_METHODS)
        for index, pane in enumerate(self.panes):
            pane.run_clicked.connect(lambda index=index: self.run_panes([index]))
        splitter = QSplitter(Qt.Orientation.Horizontal)
        for pane in self.panes:
            splitter.addWidget(pane)
        legend = QLabel(legend_html())
        legend.setTextFormat(Qt.TextFormat.RichText)
        self.comparison = QLabel()
        self.comparison.setStyleSheet("font-weight: bold;")
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addWidget(self.banner)
        layout.addWidget(self._artifact_box(options))
        layout.addWidget(self._input_box(options))
        layout.addLayout(self._run_row())
        layout.addWidget(splitter, 1)
        footer = QHBoxLayout()
        footer.addWidget(legend)
        footer.addStretch(1)
        footer.addWidget(self.comparison)
        layout.addLayout(footer)
        self.setCentralWidget(central)

    def _artifact_box(self, options: WindowOptions) -> QGroupBox:
        box = QGroupBox("Model")
        layout = QVBoxLayout(box)
        layout.addLayout(self._model_row(options))
        layout.addLayout(self._decoding_row(options))
        return box

    def _model_row(self, options: WindowOptions) -> QHBoxLayout:
        self.artifact_edit = QLineEdit()
        self.artifact_edit.setReadOnly(True)
        self.artifact_edit.setPlaceholderText("no artifact open")
        self.open_button = QPushButton("Open artifact…")
        self.open_button.clicked.connect(self.choose_artifact)
        self.backend_box = self._combo(BACKENDS, options.backend)
        self.schedule_box = self._combo(STREAM_SCHEDULES, options.stream_schedule)
        self.schedule_box.setToolTip(
            "fused: streams ride along every tree node (memory-bound devices); "
            "deferred: streams of the last accepted node only (CPUs)"
        )
        self.task_box = QComboBox()
        self.task_box.setToolTip(
            "an artifact with several tasks on one base switches between them without loading the base again"
        )
        for combo in (self.backend_box, self.schedule_box, self.task_box):  # load-time choices
            combo.currentIndexChanged.connect(self.reload)
        row = QHBoxLayout()
        row.addWidget(self.artifact_edit, 1)
        row.addWidget(self.open_button)
        self._add_labelled(
            row, ("task", self.task_box), ("backend", self.backend_box), ("streams schedule", self.schedule_box)
        )
        return row

    def _decoding_row(self, options: WindowOptions) -> QHBoxLayout:
        self.tree_edit = QLineEdit()
        self.tree_edit.setPlaceholderText(f"default: {DEFAULT_TREE}")
        self.tree_edit.setMinimumWidth(260)
        self.tree_edit.setToolTip(
            "draft tree for SS: 'gamma=G,k=K' or a JSON list of paths; empty: the artifact's "
            "tree (exported graphs take no other), else the default"
        )
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 4096)
        self.max_tokens.setValue(options.max_new_tokens)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setToolTip("0 = greedy; > 0 samples (SS stays lossless)")
        self.model_label = QLabel()
        row = QHBoxLayout()
        self._add_labelled(
            row, ("tree", self.tree_edit), ("max new tokens", self.max_tokens), ("temperature", self.temperature)
        )
        row.addWidget(self.model_label, 1)
        return row

    @staticmethod
    def _add_labelled(row: QHBoxLayout, *pairs: tuple[str, QWidget]) -> None:
        for label, widget in pairs:
            row.addWidget(QLabel(label))
            row.addWidget(widget)

    def _input_box(self, options: WindowOptions) -> QGroupBox:
        box = QGroupBox("Input dialogue")
        self.example_box = QComboBox()
        self.example_box.addItem("(paste your own)", None)
        for index, example in enumerate(self.examples):
            self.example_box.addItem(example.title, index)
        self.example_box.setEnabled(bool(self.examples))
        self.example_box.currentIndexChanged.connect(self.show_example)
        self.input_edit = QPlainTextEdit()
        self.input_edit.setPlaceholderText("#Person1#: ...\n#Person2#: ...")
        self.input_edit.setMaximumHeight(150)
        self.reference = QLabel()
        self.reference.setWordWrap(True)
        self.reference.setStyleSheet("color:#4b5563;")
        layout = QFormLayout(box)
        layout.addRow("DialogSum example", self.example_box)
        layout.addRow(self.input_edit)
        layout.addRow(self.reference)
        if self.examples:
            self.example_box.setCurrentIndex(min(options.example_index, len(self.examples) - 1) + 1)
        return box

    def _run_row(self) -> QHBoxLayout:
        self.both_button = QPushButton("Run both panes (one after the other)")
        self.both_button.setToolTip(SEQUENTIAL_NOTE)
        self.both_button.clicked.connect(lambda: self.run_panes([0, 1]))
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.clicked.connect(self.stop)
        note = QLabel(SEQUENTIAL_NOTE)
        note.setWordWrap(True)
        note.setStyleSheet("color:#6b7280;")
        row = QHBoxLayout()
        row.addWidget(self.both_button)
        row.addWidget(self.stop_button)
        row.addWidget(note, 1)
        return row

    @staticmethod
    def _combo(items: tuple[str, ...], current: str) -> QComboBox:
        box = QComboBox()
        box.addItems(list(items))
        box.setCurrentText(current)
        return box

    def _connect_worker(self) -> None:
        worker = self.worker_thread.worker
        worker.loaded.connect(self._on_loaded)
        worker.load_failed.connect(self._on_load_failed)
        worker.started.connect(self._on_started)
        worker.progressed.connect(self._on_progressed)
        worker.finished.connect(self._on_finished)
        worker.failed.connect(self._on_failed)

    # --- actions --------------------------------------------------------------------------
    @Slot()
    def choose_artifact(self) -> None:
        start = str(self.artifact or Path.cwd() / "checkpoints")
        folder = QFileDialog.getExistingDirectory(self, "Open a streamfuse artifact folder", start)
        if folder:
            self.open_artifact(Path(folder))

    def open_artifact(self, folder: Path, backend: str | None = None) -> None:
        """backend None: the fastest the artifact has on this machine (its calibrations)."""
        self.artifact = Path(folder)
        self.artifact_edit.setText(str(self.artifact))
        self.task_box.blockSignals(True)  # one load below, not one per item
        self.task_box.clear()
        self.task_box.addItems(artifact_tasks(self.artifact))
        self.task_box.blockSignals(False)
        self.backend_box.setCurrentText(backend or fastest_backend(self.artifact))
        self.reload()

    @Slot()
    def reload(self) -> None:
        if self.artifact is None:
            return
        self.loading, self.ready = True, False
        self._hide_error()
        self.model_label.setText("loading…")
        self.statusBar().showMessage(f"Loading {self.artifact} and warming it up …")
        self._update_busy()
        self.worker_thread.load_requested.emit(
            LoadRequest(
                self.artifact,
                self.backend_box.currentText(),
                self.schedule_box.currentText(),
                task=self.task_box.currentText() or None,
            )
        )

    @Slot(int)
    def show_example(self, row: int) -> None:
        index = self.example_box.itemData(row)
        if index is None:
            self.reference.clear()
            return
        example = self.examples[index]
        self.input_edit.setPlainText(example.dialogue)
        self.reference.setText(f"Reference summary: {example.references[0]}" if example.references else "")

    def run_panes(self, panes: list[int]) -> None:
        """Queue one generation per pane, in order; the worker runs them one after the other."""
        if not self.ready:
            self._show_error(f"No artifact is loaded. {BUILD_HINT}")
            return
        self._hide_error()
        self.comparison.clear()
        self.batch = list(panes)
        for index in panes:
            pane = self.panes[index]
            request = GenerationRequest(
                pane.method,
                self.input_edit.toPlainText(),
                self.tree_edit.text(),
                self.max_tokens.value(),
                self.temperature.value(),
            )
            self.stops[index] = threading.Event()
            self.outcomes.pop(index, None)
            pane.start()
            self.worker_thread.generate_requested.emit(index, request, self.stops[index])
        self.statusBar().showMessage("Generating …")
        self._update_busy()

    @Slot()
    def stop(self) -> None:
        for event in self.stops.values():
            event.set()

    # --- worker reports -------------------------------------------------------------------
    @Slot(str, str, object)
    def _on_loaded(self, description: str, default_tree: str, methods: list[tuple[str, str]]) -> None:
        self.loading, self.ready = False, True
        self.model_label.setText(description)
        self.tree_edit.setPlaceholderText(f"default: {default_tree}")
        self.statusBar().showMessage("Ready: pick an example or paste a dialogue, then Run.")
        for pane in self.panes:
            pane.set_methods(methods)
            pane.show_message("Ready.")
        self._update_busy()
        self.load_done.emit(True)

    @Slot(str)
    def _on_load_failed(self, message: str) -> None:
        self.loading = False
        self.model_label.setText("not loaded")
        self._show_error(f"{message}\n{BUILD_HINT}")
        self.statusBar().showMessage("Load failed")
        self._update_busy()
        self.load_done.emit(False)

    @Slot(int)
    def _on_started(self, index: int) -> None:
        self.statusBar().showMessage(f"Generating with {self.panes[index].method_box.currentText()} …")

    @Slot(int, object, object)
    def _on_progressed(self, index: int, segments: list, stats: RunStats) -> None:
        self.panes[index].append(segments)
        self.panes[index].show_stats(stats)

    @Slot(int, object)
    def _on_finished(self, index: int, stats: RunStats) -> None:
        self.panes[index].show_stats(stats)
        self.outcomes[index] = stats
        self._job_ended(index)

    @Slot(int, str)
    def _on_failed(self, index: int, message: str) -> None:
        self.panes[index].show_message(message, error=True)
        self._show_error(message)
        self.outcomes[index] = message
        self._job_ended(index)

    def _job_ended(self, index: int) -> None:
        self.stops.pop(index, None)
        self._update_busy()
        if not self.stops:
            self.statusBar().showMessage("Done.")
            self._compare()
            self.runs_done.emit()

    def _compare(self) -> None:
        """After "run both": the speed-up and whether the outputs agree (SS is lossless)."""
        left, right = self.outcomes.get(0), self.outcomes.get(1)
        if self.batch != [0, 1] or not (isinstance(left, RunStats) and isinstance(right, RunStats)):
            return
        if "stopped" in (left.stop_reason, right.stop_reason):
            return
        same = self.panes[0].generated_text == self.panes[1].generated_text
        self.comparison.setText(comparison(left, right, same))

    # --- state ----------------------------------------------------------------------------
    def _update_busy(self) -> None:
        busy = self.loading or bool(self.stops)
        for widget in (self.open_button, self.backend_box, self.schedule_box, self.task_box, self.both_button):
            widget.setEnabled(not busy)
        for pane in self.panes:
            pane.set_busy(busy)
        self.stop_button.setEnabled(bool(self.stops))

    def _show_build_hint(self) -> None:
        for pane in self.panes:
            pane.show_message(f"No artifact open. {BUILD_HINT}")
        self.statusBar().showMessage("Open an artifact folder to start.")

    def _show_error(self, message: str) -> None:
        self.banner.setText(message)
        self.banner.show()

    def _hide_error(self) -> None:
        self.banner.hide()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        self.stop()
        self.worker_thread.shutdown()
        super().closeEvent(event)
