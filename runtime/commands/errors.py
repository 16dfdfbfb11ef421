"""What every command-line entry point does with an error: one line, never a traceback.

The project's checks already name the problem and the fix; a user should read that line, not a
stack. Bad flags exit 2 (as argparse's own errors do), everything else 1; `--debug` (or
STREAMFUSE_DEBUG=1) re-raises for the traceback.

    if __name__ == "__main__":
        sys.exit(errors.run(main))
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable

from streamfuse.runtime.artifact.format import ArtifactError
from streamfuse.runtime.backends.base import CapacityError, EngineError
from streamfuse.runtime.backends.runners import MissingBackend

DEBUG_FLAG = "--debug"
DEBUG_HELP = "show the traceback of an error instead of its one line"


class UsageError(ValueError):
    """A flag the user can fix: exit status 2."""


# What a user can cause and fix: bad files and values (ValueError covers UnicodeDecodeError and
# ArtifactError), missing files or folders, an engine not installed or unable to serve the model, a prompt longer
# than the cache.
USER_ERRORS = (ValueError, OSError, ArtifactError, MissingBackend, EngineError, CapacityError)


# Known, harmless messages of the libraries below us (optional kernels not built for this machine,
# deprecations inside torch, transformers and ExecuTorch): hidden so a console shows our progress.
NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "torch.onnx._internal.exporter._registration")
NOISY_WARNINGS = (
    r"`is_gradient_checkpointing` is deprecated",
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"This API is experimental",
)


# ExecuTorch's runtime logs from C++ straight to file descriptor 2, past Python's warnings and logging.
NATIVE_NOISE = re.compile(rb"\[(cpuinfo_utils|threadpool)\.cpp:\d+\] ")
_native_filter: list[threading.Thread] = []


def quiet_known_noise() -> None:
    """Silence NOISY_LOGGERS, NOISY_WARNINGS, transformers' weight-loading bars and, where this
    process writes to its real stderr, the NATIVE_NOISE lines of C++ libraries."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    # transformers' bars, without importing it (the exported engines never do): it reads this when imported
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if sys.stderr is sys.__stderr__:  # not under a capture (pytest's), which owns the descriptor
        filter_native_stderr()


def filter_native_stderr() -> None:
    """Route file descriptor 2 through a pipe whose reader drops NATIVE_NOISE lines and passes the
    rest on. At exit the descriptor is restored and the pipe drained, so no last line is lost."""
    if _native_filter:
        return
    sys.stderr.flush()
    direct = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        pending = b""
        while chunk := os.read(read, 1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            out = b"".join(line + b"\n" for line in lines if not NATIVE_NOISE.search(line))
            if b"\r" in pending:  # a progress bar redrawing its line: pass it on now, not at the newline
                cut = pending.rindex(b"\r") + 1
                out, pending = out + pending[:cut], pending[cut:]
            if out:
                os.write(direct, out)
        if pending and not NATIVE_NOISE.search(pending):
            os.write(direct, pending)
        os.close(read)

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    _native_filter.append(thread)

    def drain() -> None:
        sys.stderr.flush()
        os.dup2(direct, 2)  # the pipe's last writer here closes: its reader ends once drained
        thread.join(timeout=2.0)

    atexit.register(drain)


def quiet_unless_debugging() -> None:
    """A spawned worker's initializer: as quiet as the command that spawned it (see run)."""
    if os.environ.get("STREAMFUSE_DEBUG") != "1":
        quiet_known_noise()


def add_debug_flag(parser) -> None:
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)


def check(condition: bool, message: str) -> None:
    """A flag check: UsageError(message) unless condition."""
    if not condition:
        raise UsageError(message)


def usage(check_flags: Callable[[], object]) -> object:
    """Run flag validation that raises ValueError (TreeSpec.parse, SamplingConfig, ...) as a usage error."""
    try:
        return check_flags()
    except UsageError:
        raise
    except ValueError as error:
        raise UsageError(str(error)) from error


def one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    if isinstance(error, UnicodeDecodeError):
        text = f"not UTF-8 text ({error.reason} at byte {error.start}): save the file as UTF-8"
    return " ".join(text.split())


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None, prog: str | None = None) -> int:
    """main(argv) with the project's errors as one line on stderr; the exit status to return."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = DEBUG_FLAG in argv or os.environ.get("STREAMFUSE_DEBUG") == "1"
    name = prog or os.path.basename(sys.argv[0]) or "streamfuse"
    if not debug:
        quiet_known_noise()
    before = os.environ.get("STREAMFUSE_DEBUG")
    os.environ["STREAMFUSE_DEBUG"] = "1" if debug else "0"  # what spawned workers inherit
    try:
        return main(argv)
    except USER_ERRORS as error:
        if debug:
            raise
        print(f"{name}: error: {one_line(error)}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    finally:
        if before is None:
            os.environ.pop("STREAMFUSE_DEBUG")
        else:
            os.environ["STREAMFUSE_DEBUG"] = before
