"""The files an artifact names: confined to its folder, and hashed before anything reads them.

A manifest names files by paths relative to the artifact; `inside` refuses any that would lead out of the
folder (absolute, `..`, a symbolic link pointing out). `read_checked` reads a file once, checks its bytes and
sha256 against the manifest, and hands those same bytes to the parser, so what is parsed is what was checked.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path, PurePosixPath, PureWindowsPath


class ArtifactError(ValueError):
    pass


def inside(root: Path, relative: str, what: str = "a path in the manifest") -> Path:
    """root / relative, refused unless it stays in `root` once resolved (symbolic links followed)."""
    root = Path(root)
    parts = str(relative).split("/")
    if (
        not relative
        or PurePosixPath(relative).is_absolute()
        or PureWindowsPath(relative).drive
        or "\\" in relative
        or "\0" in relative
        or ".." in parts
    ):
        raise ArtifactError(
            f"{root}: {what} {relative!r} is not a relative path inside the folder; rebuild the "
            f"artifact with streamfuse build"
        )
    path = root / relative
    try:
        resolved, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop
        raise ArtifactError(
            f"{path}: cannot be resolved ({error.__class__.__name__}); copy the artifact again"
        ) from None
    if not resolved.is_relative_to(base):
        raise ArtifactError(
            f"{path} leads outside {root} (to {resolved}): a symbolic link or path out of the artifact "
            f"is refused; copy the artifact with its files inside it (cp -rL) or rebuild it"
        )
    return path


def folder_files(folder: Path, root: Path | None = None) -> list[Path]:
    """A folder's files, sorted. A symbolic link to a folder is refused (its files would be named twice or read
    from elsewhere); with `root`, so is a linked file that resolves outside `root`."""
    files = []
    for base, folders, names in os.walk(folder):
        for name in folders:
            if os.path.islink(os.path.join(base, name)):
                raise ArtifactError(
                    f"{Path(base) / name} is a symbolic link to a folder; copy the artifact with "
                    f"its files inside it (cp -rL) or rebuild it"
                )
        files += [Path(base) / name for name in names]
    if root is not None:
        for file in files:
            inside(root, file.relative_to(root).as_posix())
    return sorted(files)


def file_digest(path: Path) -> dict:
    """bytes + sha256 of a file, or of a folder's files in sorted order (.mlpackage, a checkpoint), each named."""
    path = Path(path)
    files = folder_files(path) if path.is_dir() else [path]
    digest, size = hashlib.sha256(), 0
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
                size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def mismatch(path: Path, entry: dict, root: Path) -> str | None:
    """Why `path` (made by `inside(root, ...)`) is not the file or folder the manifest's entry records, or None."""
    if not path.exists():
        return "is missing"
    try:
        if path.is_dir():
            folder_files(path, root)
        found = file_digest(path)
    except OSError as error:
        return f"cannot be read ({error.strerror or error.__class__.__name__})"
    if found["bytes"] != entry["bytes"]:
        return f"has {found['bytes']} bytes, the manifest says {entry['bytes']}"
    if found["sha256"] != entry["sha256"]:
        return "does not match its sha256 in the manifest"
    return None


def read_checked(path: Path, entry: dict, fix: str) -> bytes:
    """A file's bytes, once they match the manifest's entry (bytes, sha256); else an ArtifactError ending in `fix`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing; {fix}") from None
    except OSError as error:
        raise ArtifactError(f"{path} cannot be read ({error.strerror or error.__class__.__name__}); {fix}") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ArtifactError(
            f"{path} differs from the manifest ({len(data)} bytes, the manifest says {entry['bytes']} "
            f"and another sha256); {fix}"
        )
    return data
