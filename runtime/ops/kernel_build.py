"""Building streamfuse's compiled kernels (runtime/kernels/*.cpp) into kernels/lib/ and recording, in its
kernels.json, what each library was built against: at package build or install time (setup.py's build_kernels)
and by `make kernels` in a checkout (`python -m streamfuse.runtime.ops.kernel_build`). Loading them is
runtime/ops/kernel_library.py's, which never compiles.

Only the standard library and kernel_library (imported by its full name) are used: setup.py loads both files by
path under those names, as streamfuse is not importable while it is being built.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from streamfuse.runtime.ops.kernel_library import (
    FORMAT,
    LIBRARIES,
    LIBRARY,
    MANIFEST,
    PORTABLE,
    KernelUnavailable,
    cpu_features,
    installed_version,
    onnxruntime_api,
    read_manifest,
    sha256_of,
    source_hash,
    source_paths,
)

# -ffp-contract=off: no fused multiply-add, the NumPy reference's arithmetic exactly. The attention's 8 lanes are
# one AVX2 register where the building CPU has it (the lanes are independent, so the sums do not change;
# -march=native's AVX-512 is slower on a Zen 4); q4 / q8 pick AVX2 / AVX-512 at run time, whatever the flags.
FLAGS = ["-std=c++20", "-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi"]
FEATURE_FLAGS = {"avx2": "-mavx2"}  # CPU feature (as /proc/cpuinfo names it) -> the flag that requires it


def required_features() -> list[str]:
    """The CPU features this build's flags require (none for a portable build or off x86-64)."""
    if os.environ.get(PORTABLE) == "1" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    return sorted(feature for feature in FEATURE_FLAGS if feature in cpu_features())


def compiler() -> str:
    """$CXX, else g++, else c++: the first line of its --version goes into the manifest."""
    if os.environ.get("CXX"):
        found = shutil.which(os.environ["CXX"])
        if not found:
            raise KernelUnavailable(
                f"CXX={os.environ['CXX']} is not an executable compiler: set CXX to one, or unset it to use g++"
            )
        return found
    found = shutil.which("g++") or shutil.which("c++")
    if not found:
        raise KernelUnavailable(
            "building streamfuse's kernels needs a C++ compiler and none is on PATH: install g++ "
            "(Debian: apt-get install g++), or install a streamfuse wheel built elsewhere"
        )
    return found


def _identity(command: str) -> str:
    try:
        done = subprocess.run([command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelUnavailable(
            f"the compiler {command} does not run ({type(error).__name__}): install g++ or set CXX"
        ) from None
    return (done.stdout.splitlines() or [command])[0].strip()


def _executorch_build(runtime_of: Callable[[Path], Path] | None) -> tuple[list[str], dict] | None:
    """Compile and link arguments for the ExecuTorch library and the versions it is for; None without executorch."""
    spec = importlib.util.find_spec("executorch")
    if runtime_of is None or spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]).resolve()
    runtime, include = runtime_of(root), root / "include"
    if not include.is_dir() or not runtime.is_file():
        raise KernelUnavailable(
            f"the executorch wheel at {root} lacks its headers or runtime library; reinstall it: "
            f"pip install --force-reinstall 'streamfuse[executorch]'"
        )
    # The runtime is loaded by executorch's bindings before this library (load_executorch_kernels): the paths
    # only matter if it is not, the build's venv and, installed, site-packages relative to this library.
    arguments = [
        "-DC10_USING_CUSTOM_GENERATED_MACROS",
        "-DET_USE_THREADPOOL",
        "-DNDEBUG",
        f"-I{include}",
        f"-I{include / 'executorch' / 'runtime' / 'core' / 'portable_type' / 'c10'}",
        str(runtime),
        f"-Wl,-rpath,{runtime.parent}",
        "-Wl,-rpath,$ORIGIN/../../../../executorch/extension/pybindings",
    ]
    return arguments, {"executorch": installed_version("executorch"), "torch": installed_version("torch")}


def _plan(name: str, runtime_of: Callable[[Path], Path] | None) -> tuple[list[str], dict] | None:
    if name == "executorch":
        return _executorch_build(runtime_of)
    return list(LIBRARY[name].link), ({"onnxruntime_api": onnxruntime_api()} if name == "onnxruntime" else {})


def _compile(command: str, name: str, flags: list[str], extra: list[str], target: Path) -> None:
    """Compile into a unique temporary file beside `target`, renamed over it once complete."""
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        sources = [str(path) for path in source_paths(name)]
        done = subprocess.run([command, *flags, *sources, "-o", partial, *extra], capture_output=True, text=True)
        if done.returncode != 0:
            first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
            raise KernelUnavailable(f"compiling streamfuse's {name} kernel library failed: {first.strip()}")
        os.chmod(partial, 0o755)  # mkstemp's 0600 would hide it from other users of an installed package
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """One build at a time per folder (a lock on the folder itself: nothing extra left in it, or in a wheel)."""
    import fcntl  # POSIX, as the build is: loading the libraries needs none of it

    handle = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def _write_manifest(directory: Path, manifest: dict) -> None:
    handle, partial = tempfile.mkstemp(dir=directory, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(manifest, stream, indent=1, sort_keys=True)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(partial, 0o644)
        os.replace(partial, directory / MANIFEST)
    finally:
        Path(partial).unlink(missing_ok=True)


def build(
    directory: Path | None = None,
    executorch_runtime: Callable[[Path], Path] | None = None,
    log: Callable[[str], None] = print,
    only_these: bool = False,
) -> dict[str, Path]:
    """Compile every library this environment can build into `directory` (LIBRARIES by default) unless it is
    there and up to date; executorch_runtime(package root) -> the runtime library to link (seams'), None: skip
    ExecuTorch. A library this run cannot build (ExecuTorch without executorch) keeps its earlier entry, unless
    only_these (a package being built: it carries what this build made, nothing older)."""
    directory = Path(directory or LIBRARIES)
    command = compiler()
    identity = _identity(command)
    flags = FLAGS + [FEATURE_FLAGS[f] for f in required_features()]
    directory.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    with _locked(directory):
        try:
            entries = dict((read_manifest(directory) or {"libraries": {}})["libraries"])
        except KernelUnavailable:  # a damaged manifest: everything is rebuilt
            entries = {}
        try:
            for name in LIBRARY:
                plan = _plan(name, executorch_runtime)
                if plan is not None:
                    entries[name] = _build_one(command, name, flags, *plan, identity, directory, entries.get(name), log)
                    built[name] = directory / LIBRARY[name].file
        finally:  # what was built is recorded even if a later library fails (its earlier entry still holds)
            if only_these:
                entries = {name: entry for name, entry in entries.items() if name in built}
            _write_manifest(directory, {"format": FORMAT, "libraries": entries})
            for name in set(LIBRARY) - set(entries):  # no entry: it could not load
                (directory / LIBRARY[name].file).unlink(missing_ok=True)
    return built


def _build_one(
    command: str,
    name: str,
    flags: list[str],
    extra: list[str],
    built_for: dict,
    identity: str,
    directory: Path,
    old: dict | None,
    log: Callable[[str], None],
) -> dict:
    """The library's manifest entry, compiled first unless the one there was built against the same."""
    key = {
        "file": LIBRARY[name].file,
        "sources": source_hash(name),
        "compiler": identity,
        "flags": flags + extra,
        "cpu_features": required_features(),
        "built_for": built_for,
        "machine": platform.machine(),
    }
    target, old = directory / LIBRARY[name].file, old or {}
    if {k: old.get(k) for k in key} == key and target.is_file() and old.get("sha256") == sha256_of(target):
        log(f"[kernels] up to date: {target}")
    else:
        _compile(command, name, flags, extra, target)
        log(f"[kernels] built {target}")
    return {**key, "sha256": sha256_of(target)}


def main() -> None:  # make kernels: build (or check) every library into the package's kernels/lib
    from streamfuse import seams

    try:
        build(LIBRARIES, seams.executorch_runtime_library)
    except OSError as error:  # KernelUnavailable, or a folder it cannot write
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
