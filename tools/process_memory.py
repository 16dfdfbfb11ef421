"""This process's memory as /proc shows it (Linux): resident bytes now and at the peak, the pages of an array
that are in memory, and the RSS a task switch leaves. A library of the memory tools (tools/memory.py,
tools/soak.py, tools/task_switch.py); standard library only, so a measured process loads nothing more.
"""

from __future__ import annotations

import sys
from pathlib import Path

STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def resident_bytes(array) -> int:
    """The bytes of a NumPy array's pages that are in memory now (mincore(2)): a page of an allocation is not
    until something writes into it."""
    import ctypes
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    first = array.ctypes.data // page * page
    length = array.ctypes.data + array.nbytes - first
    flags = (ctypes.c_ubyte * (-(-length // page)))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(length), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on the KV cache")
    return sum(flag & 1 for flag in flags) * page


def cache_resident_bytes(backend) -> int:
    return resident_bytes(backend.keys) + resident_bytes(backend.values)


def status() -> dict[str, int]:
    """This process's resident memory now (bytes), and its peak (VmHWM)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            found[key] = int(value.split()[0]) * 1024  # kB
    return found


def timed_switch(loaded, task: str, level: int):
    """loaded.with_task(task) -> (the switched model, its seconds, the RSS then above `level`)."""
    import time

    start = time.perf_counter()
    loaded = loaded.with_task(task)
    seconds = time.perf_counter() - start
    return loaded, seconds, status()["VmRSS"] - level


def child_command(module: str, args, backend: str) -> list[str]:
    """The command line that measures `backend` in a process of its own: `module` run with --child and the
    parent's artifact, limit, threads and token budget."""
    return [sys.executable, "-m", module, "--artifact", str(args.artifact), "--child", backend] + [
        "--limit",
        str(args.limit),
        "--threads",
        str(args.threads),
        "--max-new-tokens",
        str(args.max_new_tokens),
    ]
