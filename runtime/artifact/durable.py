"""Writes that survive a crash and a concurrent writer.

- `locked(file)`: an exclusive OS file lock (flock), waited for; it ends with its process, so no stale lock is
  left to clear. A folder renamed away while a writer waited leaves that writer's lock on a file no longer at its
  path: the lock is taken again on the file there now. A thread that holds it may take it again (nested).
- `write_atomic`: a unique temporary file beside the target (two writers never share one), fsynced, renamed over
  the target, the folder fsynced: a reader sees the old file or the new one, after a crash too.
- `replace_folder`: the old folder renamed aside, the new one renamed in, and only then the old one deleted.
On systems without flock (Windows) the lock is a no-op; the writes stay atomic.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

_held = threading.local()  # the lock files this thread holds (a nested `locked` does not wait on itself)


def _same_file(handle: IO, path: Path) -> bool:
    try:
        here, there = os.fstat(handle.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


@contextmanager
def locked(file: Path) -> Iterator[None]:
    """Hold the exclusive lock on `file` (created if missing) for the block, waiting while another holder has it."""
    key, held = (os.getpid(), os.path.realpath(file)), _held.__dict__.setdefault("files", set())  # a fork holds none
    if key in held:
        yield
        return
    while True:
        handle = open(file, "a+")
        if fcntl is None:
            break
        fcntl.flock(handle, fcntl.LOCK_EX)
        if _same_file(handle, file):
            break
        handle.close()  # the folder was replaced meanwhile: lock the file that is there now
    held.add(key)
    try:
        yield
    finally:
        held.discard(key)
        handle.close()  # closing releases the lock


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (a no-op where folders cannot be opened, as on Windows)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` whole, through a temporary file of this call's own."""
    path = Path(path)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(name, mode)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def replace_folder(new: Path, target: Path) -> None:
    """Put the folder `new` at `target`. An older folder there is renamed aside and deleted once `new` is in place;
    if `new` cannot be renamed in, the old one goes back."""
    new, target = Path(new), Path(target)
    aside = None
    if target.exists() or target.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))  # this call's own name
        os.rename(target, aside / target.name)
    try:
        os.rename(new, target)
    except BaseException:
        if aside is not None:
            os.rename(aside / target.name, target)
            aside.rmdir()
        raise
    fsync_folder(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
