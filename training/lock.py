"""One build per output folder: a second build into the same folder refuses, naming the first.

Two builds writing one checkpoint or artifact folder would interleave their stages' files. The
lock is an OS file lock (flock) on a file beside the folder, so it ends with its process even
when that process is killed: no stale lock to clear by hand.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class FolderBusy(OSError):
    pass


def lock_path(folder: Path) -> Path:
    folder = Path(folder).resolve()
    return folder.parent / f".{folder.name}.lock"


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """Hold `folder`'s lock for the block, or raise FolderBusy at once if another process holds it."""
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise FolderBusy(
                f"{folder} is being written by another build ({holder}); wait for it to finish or "
                f"pass another --out / --work-dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
