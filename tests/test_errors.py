"""runtime/commands/errors.py: what an entry point does with an error, and the libraries' known noise."""

import subprocess
import sys
import warnings

import pytest

from streamfuse.runtime.artifact.format import ArtifactError
from streamfuse.runtime.backends.base import CapacityError
from streamfuse.runtime.backends.runners import MissingBackend
from streamfuse.runtime.commands import errors

# raised by main -> exit status (None: not the user's to fix, so the traceback stays)
OUTCOMES = [
    (errors.UsageError("--threads must be >= 1, got 0"), 2),
    (ValueError("data.jsonl:3: not valid JSON"), 1),
    (FileNotFoundError("artifacts/x is not a folder"), 1),
    (ArtifactError("manifest.json is not valid JSON"), 1),
    (MissingBackend("onnxruntime is not installed"), 1),
    (CapacityError("KV cache full"), 1),
    (KeyboardInterrupt(), 130),
    (RuntimeError("a bug"), None),
]


@pytest.mark.parametrize("error, status", OUTCOMES, ids=[type(e).__name__ for e, _ in OUTCOMES])
def test_errors_are_one_line_with_their_exit_status(error, status, capsys):
    def main(argv):
        raise error

    if status is None:
        with pytest.raises(type(error)):
            errors.run(main, [], prog="tool")
        return
    assert errors.run(main, [], prog="tool") == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tool: ")
    assert str(error) in err if str(error) else "interrupted" in err
    with pytest.raises(type(error)):  # --debug: the traceback
        errors.run(main, ["--debug"], prog="tool")


def test_a_multi_line_message_becomes_one_line(capsys):
    def main(argv):
        raise ValueError("first line\n   second line")

    assert errors.run(main, [], prog="tool") == 1
    assert capsys.readouterr().err == "tool: error: first line second line\n"


LOUD = (
    "import warnings; from streamfuse.runtime.commands import errors; {quiet}; import torchao; "
    "warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed', FutureWarning)"
)


def test_known_library_noise_is_hidden():
    loud = subprocess.run(
        [sys.executable, "-c", LOUD.format(quiet="pass")], capture_output=True, text=True, timeout=300
    )
    assert "is_gradient_checkpointing" in loud.stderr
    quiet = subprocess.run(
        [sys.executable, "-c", LOUD.format(quiet="errors.quiet_known_noise()")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert quiet.returncode == 0 and "is_gradient_checkpointing" not in quiet.stderr
    if "Failed to load" in loud.stderr:  # torchao's optional kernels not built for this machine
        assert "Failed to load" not in quiet.stderr
    with warnings.catch_warnings():  # other warnings still show
        warnings.simplefilter("error")
        errors.quiet_known_noise()
        with pytest.raises(UserWarning):
            warnings.warn("something new", stacklevel=2)


NATIVE = """import os, sys, time
from streamfuse.runtime.commands import errors
errors.filter_native_stderr()
os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\\n")
os.write(2, b"a native line that matters\\n")
os.write(2, b"\\rbar 1/2\\rbar 2/2")
time.sleep(0.5)
os.write(2, b"\\n[threadpool.cpp:66] Resetting threadpool to 2 threads.\\n")
print("build.py: error: the last line", file=sys.stderr)
"""


def test_native_library_noise_is_dropped_and_everything_else_kept():
    """ExecuTorch's C++ logging goes straight to descriptor 2: filtered there, while other native
    lines, a progress bar's redraws (before their newline) and the last Python line all get through."""
    result = subprocess.run([sys.executable, "-c", NATIVE], capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr
    err = result.stderr.decode()
    assert "cpuinfo_utils" not in err and "threadpool.cpp" not in err
    assert "a native line that matters\n" in err and "\rbar 1/2\rbar 2/2\n" in err
    assert err.endswith("build.py: error: the last line\n")
