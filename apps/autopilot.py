"""Unattended runs (--autorun / --screenshot / --quit-after): for tests, CI and README images."""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Slot
from PySide6.QtWidgets import QApplication

from streamfuse.apps.stats import RunStats, stat_fields
from streamfuse.apps.window import MainWindow


class Autopilot(QObject):
    """Load -> (run both panes) -> screenshot -> quit; exit_code 1 if a load or a run failed."""

    def __init__(self, window: MainWindow, autorun: bool, screenshot: Path | None, quit_after: bool):
        super().__init__(window)
        self.window, self.autorun, self.screenshot, self.quit_after = window, autorun, screenshot, quit_after
        self.exit_code = 0
        self.finished = False
        if not (autorun or screenshot or quit_after):
            return  # an ordinary interactive session
        window.load_done.connect(self._on_load_done)
        if autorun:
            window.runs_done.connect(self._finish)
        if window.artifact is None:  # nothing will load: the window as it is (the build hint) is the result
            QTimer.singleShot(300, self._finish)

    @Slot(bool)
    def _on_load_done(self, ok: bool) -> None:
        if self.finished:  # a reload the user asked for later
            return
        if not ok:
            self.exit_code = 1
            print(f"demo: load failed: {self.window.banner.text()}", file=sys.stderr)
        if ok and self.autorun:
            self.window.run_panes([0, 1])
        else:
            self._finish()

    @Slot()
    def _finish(self) -> None:
        if self.finished:  # once per session; later manual runs are the user's
            return
        self.finished = True
        print(f"demo: platform {QApplication.platformName()}", flush=True)
        for index, outcome in sorted(self.window.outcomes.items()):
            pane = self.window.panes[index]
            if isinstance(outcome, RunStats):
                figures = ", ".join(f"{label} {value}" for label, value in stat_fields(outcome))
                print(f"demo: {pane.method}: {figures}", flush=True)
            else:
                self.exit_code = 1
                print(f"demo: {pane.method} failed: {outcome}", file=sys.stderr, flush=True)
        if self.screenshot is not None:
            QApplication.processEvents()  # lay out what the last reports changed before grabbing
            self.screenshot.parent.mkdir(parents=True, exist_ok=True)
            if not self.window.grab().save(str(self.screenshot)):
                self.exit_code = 1
                print(f"demo: could not write {self.screenshot}", file=sys.stderr)
            else:
                print(f"demo: screenshot saved to {self.screenshot}", flush=True)
        if self.quit_after:
            self.window.close()
            QApplication.instance().quit()
