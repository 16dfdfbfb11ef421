"""streamfuse's compiled kernels (runtime/kernels/*.cpp): built when the package is built or installed
(setup.py's build_kernels; `make kernels` in a checkout), only loaded at run time, so a device without a
compiler runs every engine.

Each library goes into kernels/lib/ beside the sources, and kernels/lib/kernels.json records what it was
built against: its sources' hash, the compiler and flags, the CPU features the flags require, the engine
versions it was built for and its own sha256.

    c            the C ABI (tree attention, commit_rows, q4 / q8 linear) behind the torch ops, through ctypes
    onnxruntime  the ONNX Runtime custom ops; it declares the few C API entries it calls (no ORT headers)
    executorch   the ExecuTorch ops, against the executorch wheel's headers and runtime (built where importable)

A library loads only if all of that matches this process and machine; anything else is a one-line
KernelUnavailable naming the fix, never a compile and never an illegal instruction. Only the standard library
is imported here: setup.py loads this file by path (streamfuse is not importable while it is being built).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

SOURCES = Path(__file__).resolve().parents[1] / "kernels"
LIBRARIES = SOURCES / "lib"
MANIFEST = "kernels.json"
FORMAT = 1
# -ffp-contract=off: no fused multiply-add, the NumPy reference's arithmetic exactly. The attention's 8 lanes are
# one AVX2 register where the building CPU has it (the lanes are independent, so the sums do not change;
# -march=native's AVX-512 is slower on a Zen 4); q4 / q8 pick AVX2 / AVX-512 at run time, whatever the flags.
FLAGS = ["-std=c++20", "-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi"]
FEATURE_FLAGS = {"avx2": "-mavx2"}  # CPU feature (as /proc/cpuinfo names it) -> the flag that requires it
PORTABLE = "STREAMFUSE_PORTABLE_KERNELS"  # set to 1 at build time: no -mavx2 (a wheel for any x86-64 CPU)
REINSTALL = (
    "reinstall streamfuse (pip install --force-reinstall <its wheel or checkout>) or, in a checkout, run `make kernels`"
)


class KernelUnavailable(OSError):
    """A library that is not built, or not for this process and machine: an OSError, as a missing file is, so the
    CLIs report it in one line."""


class Library(NamedTuple):
    file: str
    sources: tuple[str, ...]
    link: tuple[str, ...] = ()


LIBRARY = {
    "c": Library(
        "libstreamfuse_attention.so", ("tree_attention_c.cpp", "q4_linear_c.cpp", "q8_linear_c.cpp"), ("-pthread",)
    ),
    "onnxruntime": Library("libstreamfuse_attention_ort.so", ("tree_attention_ort.cpp",)),
    "executorch": Library("libstreamfuse_attention_et.so", ("tree_attention_et.cpp",)),
}


# --- what a library is built against -------------------------------------------------------------
def source_hash(name: str, sources: Path | None = None) -> str:
    """sha256 over a library's sources and every header (names and bytes)."""
    sources = sources or SOURCES
    digest = hashlib.sha256()
    for file in sorted({*LIBRARY[name].sources, *(header.name for header in sources.glob("*.h"))}):
        digest.update(file.encode() + b"\0" + (sources / file).read_bytes())
    return digest.hexdigest()


def installed_version(package: str) -> str | None:
    """The installed version without a local tag (torch's 2.13.0+cpu is PyPI's 2.13.0); None if absent."""
    try:
        return importlib.metadata.version(package).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set extensions, lower case: /proc/cpuinfo's flags, macOS's sysctl; else none known."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    if sys.platform == "darwin":
        keys = ["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"]
        try:
            found = subprocess.run(keys, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return frozenset()
        return frozenset(found.lower().replace(".", "_").split())
    return frozenset()


def _required_features() -> list[str]:
    if os.environ.get(PORTABLE) == "1" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    return sorted(feature for feature in FEATURE_FLAGS if feature in cpu_features())


def onnxruntime_api(sources: Path | None = None) -> int:
    """The ONNX Runtime C API version the op library asks for (its source's kApiVersion)."""
    text = ((sources or SOURCES) / LIBRARY["onnxruntime"].sources[0]).read_text()
    return int(re.search(r"kApiVersion = (\d+)", text).group(1))


# --- building ------------------------------------------------------------------------------------
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(command: str, name: str, flags: list[str], extra: list[str], target: Path) -> None:
    """Compile into a unique temporary file beside `target`, renamed over it once complete."""
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        sources = [str(SOURCES / source) for source in LIBRARY[name].sources]
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
    flags = FLAGS + [FEATURE_FLAGS[f] for f in _required_features()]
    directory.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    with _locked(directory):
        try:
            entries = dict((_read_manifest(directory) or {"libraries": {}})["libraries"])
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
        "cpu_features": _required_features(),
        "built_for": built_for,
        "machine": platform.machine(),
    }
    target, old = directory / LIBRARY[name].file, old or {}
    if {k: old.get(k) for k in key} == key and target.is_file() and old.get("sha256") == _sha256(target):
        log(f"[kernels] up to date: {target}")
    else:
        _compile(command, name, flags, extra, target)
        log(f"[kernels] built {target}")
    return {**key, "sha256": _sha256(target)}


# --- loading -------------------------------------------------------------------------------------
def _read_manifest(directory: Path) -> dict | None:
    """The folder's kernels.json, None if absent; KernelUnavailable if unreadable or of another format."""
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise KernelUnavailable(
            f"streamfuse's kernel manifest {path} is unreadable ({type(error).__name__}): {REINSTALL}"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("libraries"), dict)
        or not all(_well_formed(n, e) for n, e in manifest["libraries"].items())
    ):
        raise KernelUnavailable(f"streamfuse's kernel manifest {path} is not of format {FORMAT}: {REINSTALL}")
    return manifest


# an entry's key -> the type its value must have (build() writes them all)
ENTRY = {
    "file": str,
    "sources": str,
    "compiler": str,
    "flags": list,
    "cpu_features": list,
    "built_for": dict,
    "machine": str,
    "sha256": str,
}


def _well_formed(name: str, entry) -> bool:
    return (
        name in LIBRARY
        and isinstance(entry, dict)
        and all(isinstance(entry.get(k), t) for k, t in ENTRY.items())
        and entry["file"] == LIBRARY[name].file
        and all(isinstance(f, str) for f in entry["cpu_features"])
        and all(isinstance(v, int if k == "onnxruntime_api" else str) for k, v in entry["built_for"].items())
    )


def _mismatch(name: str, entry: dict, directory: Path) -> tuple[str, str] | None:
    """What keeps a built library from loading here, and its fix; None if it may load."""
    if platform.machine() != entry.get("machine"):
        return f"was built for {entry.get('machine')}, this machine is {platform.machine()}", REINSTALL
    lacking = sorted(set(entry.get("cpu_features") or []) - cpu_features())
    if lacking:
        return (
            f"was compiled for CPUs with {', '.join(lacking)} and this CPU lacks it",
            "build streamfuse on "
            f"this machine (pip install --force-reinstall <checkout>, or make kernels), or with {PORTABLE}=1 "
            f"where it is built",
        )
    present = all((SOURCES / source).is_file() for source in LIBRARY[name].sources)  # a wheel carries them
    if present and entry.get("sources") != source_hash(name):
        return f"was built from other sources than {SOURCES} (edited since)", REINSTALL
    for package, version in (entry.get("built_for") or {}).items():
        if package == "onnxruntime_api":
            found = installed_version("onnxruntime")
            if found and tuple(int(p) for p in found.split(".")[:2] if p.isdigit()) < (1, int(version)):
                return (
                    f"needs ONNX Runtime 1.{version} or later (C API {version}), {found} is installed",
                    "pip install 'streamfuse[onnxruntime]'",
                )
        elif installed_version(package) != version:
            return f"was built for {package} {version}, {installed_version(package) or 'none'} is installed", REINSTALL
    target = directory / LIBRARY[name].file
    if not target.is_file() or _sha256(target) != entry.get("sha256"):
        return f"file {target} is missing or not the one built", REINSTALL
    return None


def library_path(name: str) -> Path:
    """The compiled library `name` (a key of LIBRARY), checked against this process and machine."""
    manifest = _read_manifest(LIBRARIES)
    entry = (manifest or {"libraries": {}})["libraries"].get(name)
    if entry is None:
        fix = REINSTALL
        if name == "executorch":
            fix = (
                "with executorch installed, run `make kernels` in a checkout or reinstall streamfuse with it "
                "visible to the build (pip install --no-build-isolation --force-reinstall <checkout>)"
            )
        raise KernelUnavailable(
            f"streamfuse's {name} kernel library is not built (no entry in {LIBRARIES / MANIFEST}): {fix}"
        )
    problem = _mismatch(name, entry, LIBRARIES)
    if problem:
        raise KernelUnavailable(f"streamfuse's {name} kernel library {problem[0]}: {problem[1]}")
    return LIBRARIES / entry["file"]


def _open(path: Path, mode: int = ctypes.DEFAULT_MODE) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path), mode=mode)
    except OSError as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise KernelUnavailable(f"streamfuse's kernel library {path} does not load ({reason}): {REINSTALL}") from None


def load_c_library() -> ctypes.CDLL:
    """The C ABI library (the caller declares its functions' types)."""
    return _open(library_path("c"))


def onnxruntime_library_path() -> Path:
    """The ONNX Runtime custom-op library, for SessionOptions.register_custom_ops_library."""
    return library_path("onnxruntime")


def executorch_library_path() -> Path:
    if importlib.util.find_spec("executorch") is None:
        raise KernelUnavailable(
            "the ExecuTorch tree attention kernel needs executorch: pip install 'streamfuse[executorch]'"
        )
    return library_path("executorch")


@functools.cache
def load_executorch_kernels() -> None:
    """Register streamfuse's ops (tree_attention.out, commit_rows.out, q4 / q8 linear) with ExecuTorch's runtime
    in this process, before a program that calls them loads; the library links the runtime the bindings load."""
    path = executorch_library_path()
    from executorch.extension.pybindings import portable_lib  # noqa: F401  (loads the runtime first)

    _open(path, ctypes.RTLD_GLOBAL)


def main() -> None:  # make kernels: build (or check) every library into the package's kernels/lib
    from streamfuse import seams

    try:
        build(LIBRARIES, seams.executorch_runtime_library)
    except OSError as error:  # KernelUnavailable, or a folder it cannot write
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
