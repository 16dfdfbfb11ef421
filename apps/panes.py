"""One output pane: a method picker, the marked-up summary as it streams in, and its figures."""

from __future__ import annotations

import html

from PySide6.QtCore import Signal
from PySide6.QtGui import QBrush, QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from streamfuse.apps.demo_controller import DEFAULT_METHODS, method_choices
from streamfuse.apps.markup import LEGEND, STYLES, Segment, Style, output_text
from streamfuse.apps.stats import RunStats, stat_fields


def char_format(style: Style) -> QTextCharFormat:
    fmt = QTextCharFormat()
    if style.foreground:
        fmt.setForeground(QBrush(QColor(style.foreground)))
    if style.background:
        fmt.setBackground(QBrush(QColor(style.background)))
    fmt.setFontWeight(QFont.Weight.Bold if style.bold else QFont.Weight.Normal)
    fmt.setFontStrikeOut(style.strike)
    return fmt


def legend_html() -> str:
    """The key to the colours, as rich text for a QLabel."""
    parts = []
    for kind, label in LEGEND.items():
        style = STYLES[kind]
        css = [
            f"color:{style.foreground}" if style.foreground else "",
            f"background-color:{style.background}" if style.background else "",
            "font-weight:bold" if style.bold else "",
            "text-decoration:line-through" if style.strike else "",
        ]
        parts.append(f'<span style="{";".join(c for c in css if c)}">&nbsp;{html.escape(label)}&nbsp;</span>')
    return "Key: " + " &nbsp; ".join(parts)


class RunPane(QWidget):
    run_clicked = Signal()

    def __init__(self, method: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.method_box = QComboBox()
        self.set_methods(method_choices(DEFAULT_METHODS), method)
        self.run_button = QPushButton("Run")
        self.run_button.clicked.connect(self.run_clicked)
        self.output = QTextBrowser()
        self.output.setMinimumHeight(140)
        self.stat_values: dict[str, QLabel] = {}
        self.segments: list[Segment] = []  # of the current run
        layout = QVBoxLayout(self)
        header = QHBoxLayout()
        header.addWidget(self.method_box, 1)
        header.addWidget(self.run_button)
        layout.addLayout(header)
        layout.addWidget(self.output, 1)
        layout.addLayout(self._stats_grid())

    def _stats_grid(self) -> QGridLayout:
        grid = QGridLayout()
        for column, (label, value) in enumerate(stat_fields(RunStats(""))):
            name = QLabel(label)
            name.setStyleSheet("color: #6b7280;")
            self.stat_values[label] = QLabel(value)
            self.stat_values[label].setStyleSheet("font-weight: bold;")
            grid.addWidget(name, 0, column)
            grid.addWidget(self.stat_values[label], 1, column)
        return grid

    def set_methods(self, choices: list[tuple[str, str]], current: str | None = None) -> None:
        """The selector's (name, label) choices; keeps `current` (default: the selected one) where it is one."""
        current = current or self.method
        self.method_box.clear()
        for name, label in choices:
            self.method_box.addItem(label, name)
        self.method_box.setCurrentIndex(max(self.method_box.findData(current), 0))

    @property
    def method(self) -> str:
        return self.method_box.currentData()

    @property
    def generated_text(self) -> str:
        return output_text(self.segments)

    def start(self) -> None:
        self.segments = []
        self.output.clear()
        self.show_stats(RunStats(self.method))

    def append(self, segments: list[Segment]) -> None:
        self.segments += segments
        cursor = self.output.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        for segment in segments:
            cursor.insertText(segment.text, char_format(STYLES[segment.kind]))
        self.output.setTextCursor(cursor)
        self.output.ensureCursorVisible()

    def show_stats(self, stats: RunStats) -> None:
        for label, value in stat_fields(stats):
            self.stat_values[label].setText(value)

    def show_message(self, text: str, error: bool = False) -> None:
        """A note instead of output (no artifact yet, or what went wrong)."""
        colour = "#b91c1c" if error else "#374151"
        self.output.setHtml(f'<p style="color:{colour}">{html.escape(text)}</p>')

    def set_busy(self, busy: bool) -> None:
        self.method_box.setEnabled(not busy)
        self.run_button.setEnabled(not busy)
