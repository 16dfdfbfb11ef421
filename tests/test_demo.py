"""Desktop demo (apps/): step markup and figures without Qt, the window off screen, the app under Xvfb."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamfuse.apps.demo_controller import DemoController, GenerationRequest, LoadRequest
from streamfuse.apps.examples import read_examples
from streamfuse.apps.markup import ACCEPTED, CORRECTION, PLAIN, REJECTED, Segment, SegmentBuilder, output_text
from streamfuse.apps.stats import RunStats, comparison, stat_fields
from streamfuse.runtime.methods import registry as methods
from streamfuse.runtime.request.completion import Completion, Stats
from streamfuse.runtime.request.decode import StepEvent
from streamfuse.runtime.request.loader import BACKENDS
from streamfuse.runtime.request.trace import RunRecord

ROOT = Path(__file__).resolve().parents[1]
NAMES = "zero one two three four five six seven eight nine ten eleven".split()


def decode_words(tokens) -> str:
    return " ".join(NAMES[t] for t in tokens)


def test_segments_mark_accepted_rejected_and_correction():
    builder = SegmentBuilder(decode_words)
    assert builder.add(StepEvent([1], 0, [])) == [Segment(PLAIN, "one")]  # prefill: no draft yet
    # drafted 2 3 9, target agreed on 2 3 then said 4: "9" was rejected, "4" is the correction
    assert builder.add(StepEvent([2, 3, 4], 2, [2, 3, 9])) == [
        Segment(ACCEPTED, " two three"),
        Segment(REJECTED, " nine"),
        Segment(CORRECTION, " four"),
    ]
    assert builder.add(StepEvent([5], 0, [7, 8])) == [Segment(REJECTED, " seven eight"), Segment(CORRECTION, " five")]
    # a stop rule inside the accepted drafts: no correction, so nothing was rejected either
    assert builder.add(StepEvent([6], 1, [6, 10])) == [Segment(ACCEPTED, " six")]
    assert builder.text == "one two three four five six"


def test_output_text_drops_rejected_drafts():
    segments = [Segment(PLAIN, "a"), Segment(ACCEPTED, " b"), Segment(REJECTED, " x"), Segment(CORRECTION, " c")]
    assert output_text(segments) == "a b c"


def test_stats_call_reduction_and_mean_accepted_length():
    stats = RunStats("ss")
    assert stats.call_reduction is None and stats.mean_accepted is None and stats.tokens_per_second is None
    assert dict(stat_fields(stats)) == {
        "tokens": "0",
        "tokens/s": "-",
        "model calls": "0",
        "CR": "-",
        "mean accepted": "-",
        "fallback": "-",
        "time": "-",
        "stop": "-",
    }
    stats.add(StepEvent([1], 0, []), 0.5)  # prefill: a call, not a verify step
    stats.add(StepEvent([2, 3, 4], 2, [2, 3, 9]), 1.0)
    stats.add(StepEvent([5], 0, [7, 8]), 2.0)
    assert (stats.new_tokens, stats.model_calls, stats.verify_steps, stats.accepted_drafts) == (5, 3, 2, 2)
    assert stats.call_reduction == pytest.approx(5 / 3) and stats.mean_accepted == 1.0
    assert stats.tokens_per_second == 2.5
    fields = dict(stat_fields(stats))
    assert fields["CR"] == "1.67" and fields["mean accepted"] == "1.00" and fields["stop"] == "running"
    for event in (StepEvent([6], 0, [], plain=True), StepEvent([7], 0, [], plain=True), StepEvent([8, 9], 1, [8, 3])):
        stats.add(event, 2.5)  # the fallback decodes two tokens plainly, then speculation resumes
    assert (stats.plain_steps, stats.switches, stats.verify_steps) == (2, 2, 3)
    assert dict(stat_fields(stats))["fallback"] == "2 plain steps, 2 switches"
    stats.finish(Completion("text", [5, 6], "eos", Stats(6, 3, 1.0, 4, 3.0, 10, 0.5, 10), RunRecord("0", 10, "ss")))
    assert stats.call_reduction == 1.5 and dict(stat_fields(stats))["stop"] == "eos"


def test_comparison_line():
    ar, ss = (
        RunStats("ar", 10, 10, seconds=2.0, stop_reason="eos"),
        RunStats("ss", 10, 5, seconds=1.0, stop_reason="eos"),
    )
    assert comparison(ar, ss, True) == "SS vs AR: speed 2.00x, model calls 5 vs 10, same output"
    assert comparison(ar, RunStats("ss", stop_reason="stopped"), False).endswith(
        "outputs differ (expected only when sampling)"
    )


def test_examples_read_dialogsum_rows(checkpoint):
    examples = read_examples(checkpoint / "data" / "dialogsum.test.jsonl", limit=4)
    assert [e.id for e in examples] == ["test_0", "test_1", "test_2", "test_3"]
    assert examples[0].dialogue.startswith("#Person1#:") and len(examples[0].references) == 3


@pytest.fixture(scope="module")
def controller(checkpoint):
    controller = DemoController()
    controller.load(LoadRequest(checkpoint / "ckpt"))
    return controller


def dialogue(checkpoint) -> str:
    return read_examples(checkpoint / "data" / "dialogsum.test.jsonl", limit=1)[0].dialogue


def test_demo_controller_streams_segments_and_speculation_is_lossless(controller, checkpoint):
    outputs = {}
    for method in ("ar", "ss"):
        segments = []
        stats = controller.generate(
            GenerationRequest(method, dialogue(checkpoint), max_new_tokens=16),
            lambda new, _stats: segments.extend(new),
            threading.Event(),
        )
        outputs[method] = (output_text(segments), stats)
    (ar_text, ar), (ss_text, ss) = outputs["ar"], outputs["ss"]
    assert ar_text and ss_text == ar_text  # same tokens: speculative decoding is exact
    assert ar.model_calls == ar.new_tokens and ar.call_reduction == 1.0 and ar.mean_accepted is None
    assert ss.new_tokens == ar.new_tokens and ss.model_calls <= ar.model_calls and ss.stop_reason


def test_demo_controller_stop_ends_after_the_current_step(controller, checkpoint):
    stop = threading.Event()
    stats = controller.generate(
        GenerationRequest("ss", dialogue(checkpoint), max_new_tokens=16), lambda _new, _stats: stop.set(), stop
    )
    assert stats.stop_reason == "stopped" and stats.model_calls == 1


def test_demo_controller_reports_bad_requests(controller, tmp_path):
    with pytest.raises(ValueError, match="input is empty"):
        controller.generate(GenerationRequest("ss", "  "), lambda *_: None, threading.Event())
    with pytest.raises(ValueError, match="method 'medusa' is not available for this model; it decodes with ar, "):
        controller.generate(GenerationRequest("medusa", "x"), lambda *_: None, threading.Event())
    with pytest.raises(ValueError, match="tree"):
        controller.generate(GenerationRequest("ss", "x", tree="gamma=3"), lambda *_: None, threading.Event())
    with pytest.raises(ValueError, match="111,111,111 nodes is larger than"):  # refused before it is enumerated
        controller.generate(GenerationRequest("ss", "x", tree="gamma=8,k=10"), lambda *_: None, threading.Event())
    with pytest.raises(FileNotFoundError, match="streamfuse.json"):
        DemoController().load(LoadRequest(tmp_path))


# --- the window, off screen ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def qapp():
    widgets = pytest.importorskip("PySide6.QtWidgets", reason="PySide6 is not installed (pip install -e '.[app]')")
    return widgets.QApplication.instance() or widgets.QApplication([])


def wait_for(app, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the worker"
        app.processEvents()
        time.sleep(0.01)


def open_window(artifact: Path | None, examples=(), max_new_tokens: int = 16):
    from streamfuse.apps.window import MainWindow, WindowOptions
    from streamfuse.apps.worker import WorkerThread

    return MainWindow(WorkerThread(), WindowOptions(artifact, max_new_tokens=max_new_tokens, examples=tuple(examples)))


def unstruck_text(pane) -> str:
    """The pane's text without struck-through (rejected) fragments."""
    block, parts = pane.output.document().begin(), []
    while block.isValid():
        iterator = block.begin()
        while not iterator.atEnd():
            fragment = iterator.fragment()
            if not fragment.charFormat().fontStrikeOut():
                parts.append(fragment.text())
            iterator += 1
        block = block.next()
    return "".join(parts)


def test_window_runs_both_panes_through_the_worker(qapp, checkpoint):
    examples = read_examples(checkpoint / "data" / "dialogsum.test.jsonl")
    window = open_window(checkpoint / "ckpt", examples)
    try:
        wait_for(qapp, lambda: not window.loading)
        assert "torch backend" in window.model_label.text() and not window.banner.isVisibleTo(window)
        # The selectors list the registry's methods this checkpoint decodes with (none needs a drafter file).
        carried = [name for name in methods.names() if not methods.get(name).artifact_entries]
        for pane, current in zip(window.panes, ("ar", "ss")):
            assert [pane.method_box.itemData(i) for i in range(pane.method_box.count())] == carried
            assert pane.method == current
        assert window.input_edit.toPlainText() == examples[0].dialogue
        assert window.reference.text().startswith("Reference summary:")
        window.both_button.click()
        assert window.stop_button.isEnabled() and not window.both_button.isEnabled()
        wait_for(qapp, lambda: len(window.outcomes) == 2)
        ar, ss = window.outcomes[0], window.outcomes[1]
        assert isinstance(ar, RunStats) and isinstance(ss, RunStats), window.outcomes
        ar_pane, ss_pane = window.panes
        assert ar_pane.output.toPlainText() and unstruck_text(ss_pane) == ar_pane.output.toPlainText()
        assert ar_pane.stat_values["CR"].text() == "1.00"
        assert ss_pane.stat_values["CR"].text() == f"{ss.call_reduction:.2f}"
        assert ss_pane.stat_values["model calls"].text() == str(ss.model_calls)
        assert ss_pane.stat_values["stop"].text() == dict(stat_fields(ss))["stop"] != "running"
        assert window.both_button.isEnabled() and not window.stop_button.isEnabled()
        assert window.comparison.text().startswith("SS vs AR: speed") and window.comparison.text().endswith(
            "same output"
        )
    finally:
        window.close()


def test_window_stop_cancels_the_running_and_the_queued_generation(qapp, checkpoint):
    window = open_window(
        checkpoint / "ckpt", read_examples(checkpoint / "data" / "dialogsum.test.jsonl"), max_new_tokens=200
    )
    try:
        wait_for(qapp, lambda: not window.loading)
        window.both_button.click()
        window.stop_button.click()  # long before the first run's 200 tokens: the second never starts
        wait_for(qapp, lambda: len(window.outcomes) == 2)
        assert window.outcomes[1].stop_reason == "stopped" and window.outcomes[1].model_calls == 0
        assert window.outcomes[0].new_tokens < 200 and window.outcomes[0].stop_reason in ("stopped", "eos")
        assert window.panes[1].stat_values["stop"].text() == "stopped" and window.comparison.text() == ""
        assert window.both_button.isEnabled() and not window.stop_button.isEnabled()
    finally:
        window.close()


def test_window_without_artifact_says_how_to_build_one(qapp):
    window = open_window(None)
    try:
        assert "make build" in window.panes[0].output.toPlainText()
        assert [window.backend_box.itemText(i) for i in range(window.backend_box.count())] == list(BACKENDS)
        window.both_button.click()  # nothing loaded: an explanation, not a crash
        assert window.banner.isVisibleTo(window) and "streamfuse build" in window.banner.text()
    finally:
        window.close()


def test_window_shows_load_errors(qapp, tmp_path):
    window = open_window(tmp_path)
    try:
        wait_for(qapp, lambda: not window.loading)
        assert window.banner.isVisibleTo(window) and "streamfuse.json" in window.banner.text()
        assert window.open_button.isEnabled()
    finally:
        window.close()
    assert window.worker_thread.thread.isFinished()  # closing the window ends the worker thread


# --- the real app under a virtual X server -----------------------------------------------------


def start_xvfb() -> tuple[subprocess.Popen, str]:
    """Xvfb on a free display number: it writes the number it took, then a newline, to
    -displayfd once it accepts connections (closing the pipe before the newline kills it)."""
    read_end, write_end = os.pipe()
    server = subprocess.Popen(
        ["Xvfb", "-displayfd", str(write_end), "-screen", "0", "1280x1024x24", "-nolisten", "tcp"],
        pass_fds=(write_end,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_end)
    answer, deadline = b"", time.monotonic() + 15
    while not answer.endswith(b"\n") and time.monotonic() < deadline:
        if select.select([read_end], [], [], 0.5)[0]:
            chunk = os.read(read_end, 16)
            if not chunk:
                break
            answer += chunk
    os.close(read_end)
    if not answer.endswith(b"\n"):
        server.kill()
        pytest.fail(f"Xvfb did not report a display within 15 s (got {answer!r}, exit code {server.poll()})")
    return server, f":{answer.decode().strip()}"


def test_app_under_xvfb_saves_a_screenshot(qapp, checkpoint, tmp_path):
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    from PIL import Image

    server, display = start_xvfb()
    try:
        env = {**os.environ, "DISPLAY": display}
        env.pop("QT_QPA_PLATFORM")  # the real xcb platform this time
        shot = tmp_path / "demo.png"
        command = [
            sys.executable,
            str(ROOT / "apps" / "demo.py"),
            "--artifact",
            str(checkpoint / "ckpt"),
            "--examples",
            str(checkpoint / "data" / "dialogsum.test.jsonl"),
            "--max-new-tokens",
            "16",
            "--autorun",
            "--screenshot",
            str(shot),
            "--quit-after",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.terminate()
        server.wait(10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "demo: platform xcb" in done.stdout and "demo: ar: tokens" in done.stdout and "demo: ss: tokens" in done.stdout
    )
    image = Image.open(shot).convert("RGB")
    assert image.width >= 800 and image.height >= 600
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # drawn widgets and text, not a blank window
    assert max(count for count, _ in colours) < 0.95 * image.width * image.height
