"""--threads on every backend: ONNX Runtime and ExecuTorch take it when their session opens
(runtime/backends/runners.py); torch, where this process has loaded it, takes it here.

A count is bounded: far more threads than cores only makes the engines slower, and a huge count makes them
allocate a pool per thread before failing, or crash."""

from __future__ import annotations

import argparse
import os
import sys

THREADS_PER_CPU = 4  # the most threads per CPU a count may ask for
MOST_THREADS = 256  # and the most on any machine


def max_threads() -> int:
    """The largest thread count accepted on this machine."""
    return min(MOST_THREADS, THREADS_PER_CPU * (os.cpu_count() or 1))


def threads_problem(threads: object) -> str | None:
    """What is wrong with a thread count (a phrase to follow the flag's name), or None if it is fine."""
    if isinstance(threads, bool) or not isinstance(threads, int):
        return f"must be a whole number of threads, got {threads!r}"
    if threads < 1:
        return f"must be >= 1, got {threads}"
    if threads > max_threads():
        return f"must be <= {max_threads()} ({THREADS_PER_CPU} per CPU here, at most {MOST_THREADS}), got {threads}"
    return None


def check_threads(threads: object, flag: str = "--threads") -> None:
    """ValueError (one line, naming `flag`) unless `threads` is None or a whole number in 1..max_threads()."""
    problem = None if threads is None else threads_problem(threads)
    if problem:
        raise ValueError(f"{flag} {problem}")


def threads_type(text: str) -> int:
    """The argparse type of every --threads flag: a whole number in 1..max_threads(), else argparse's one error
    line (`error: argument --threads: must be >= 1, got 0`)."""
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(threads_problem(text)) from None
    problem = threads_problem(threads)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return threads


def use_threads(threads: int | None) -> int:
    """Give torch `threads` if it is loaded (None: leave its own); the count a trace records. Without
    torch (an exported engine on its own), an unset count is the engine's default, one per CPU."""
    check_threads(threads)
    torch = sys.modules.get("torch")
    if torch is None:
        return threads or os.cpu_count() or 1
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
