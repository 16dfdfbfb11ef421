"""python apps/demo.py [--artifact DIR]: watch Speculative Streaming decode, next to plain decoding.

Open a model folder (streamfuse build output: artifacts/dialogsum, or checkpoints/dialogsum-cpu/ss), pick a
DialogSum dialogue or paste one, and run. Each SS step shows its accepted draft tokens
(green), the draft tokens it rejected (struck through, red) and the model's correction
token (bold), with live tokens/s, model calls, call reduction and mean accepted length.

    --autorun --screenshot demo.png --quit-after     load, run both panes, save a PNG, exit
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from streamfuse.apps.examples import DEFAULT_EXAMPLES, read_examples
from streamfuse.runtime.backends.threads import check_threads
from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.options import add_model_options
from streamfuse.runtime.request.loader import BACKENDS, fastest_backend


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--examples",
        type=Path,
        default=DEFAULT_EXAMPLES,
        help="DialogSum JSON lines to pick dialogues from (default: ../shared/data/dialogsum test split)",
    )
    parser.add_argument("--example", type=int, default=0, help="index of the example selected at start")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="initial 'max new tokens' setting")
    parser.add_argument("--autorun", action="store_true", help="once the artifact loads, run both panes")
    parser.add_argument(
        "--screenshot", type=Path, default=None, help="save a PNG of the window when the autorun (or the load) is done"
    )
    parser.add_argument("--quit-after", action="store_true", help="exit after the autorun / screenshot")
    add_model_options(parser, artifact="optional: open it at start; without it the window says how to build one")
    errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.autorun and args.artifact is None:
        parser.error("--autorun needs --artifact")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        check_threads(args.threads)
    except ValueError as error:
        parser.error(str(error))
    if args.examples != DEFAULT_EXAMPLES and not args.examples.is_file():
        parser.error(f"--examples {args.examples}: no such file")
    return args


def choose_platform(args: argparse.Namespace) -> str | None:
    """Without a display Qt aborts; a screenshot-only run can still render off screen."""
    has_display = any(os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))
    if has_display or sys.platform != "linux":
        return None
    if args.screenshot is not None and args.quit_after:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        return None
    return (
        "no display: set DISPLAY (or run under `xvfb-run`), or pass --screenshot PNG --quit-after to render off screen"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = choose_platform(args)
    if problem:
        print(f"streamfuse demo: {problem}", file=sys.stderr)
        return 2
    try:
        from PySide6.QtWidgets import QApplication
    except ImportError:
        print("streamfuse demo: PySide6 is missing; install it with  pip install -e '.[app]'", file=sys.stderr)
        return 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from streamfuse.apps.autopilot import Autopilot
    from streamfuse.apps.window import MainWindow, WindowOptions
    from streamfuse.apps.worker import WorkerThread

    examples = tuple(read_examples(args.examples)) if args.examples and args.examples.is_file() else ()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    worker_thread = WorkerThread()
    backend = args.backend or (fastest_backend(args.artifact) if args.artifact is not None else BACKENDS[0])
    window = MainWindow(
        worker_thread,
        WindowOptions(args.artifact, backend, args.stream_schedule, args.max_new_tokens, examples, args.example),
    )
    pilot = Autopilot(window, args.autorun, args.screenshot, args.quit_after)
    window.show()
    code = app.exec()
    worker_thread.shutdown()
    return code or pilot.exit_code


if __name__ == "__main__":
    sys.exit(errors.run(main))
