"""Loading streamfuse's compiled kernels (runtime/kernels/*.cpp): what each library is, what it was built against,
and the check that it may load in this process. Nothing here compiles: runtime/ops/kernel_build.py builds them
when the package is built or installed (setup.py's build_kernels; `make kernels` in a checkout), so a device
without a compiler runs every engine.

Each library sits in kernels/lib/ beside the sources, and kernels/lib/kernels.json records what it was
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
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

SOURCES = Path(__file__).resolve().parents[1] / "kernels"
LIBRARIES = SOURCES / "lib"
MANIFEST = "kernels.json"
FORMAT = 1
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


def onnxruntime_api(sources: Path | None = None) -> int:
    """The ONNX Runtime C API version the op library asks for (its source's kApiVersion)."""
    text = ((sources or SOURCES) / LIBRARY["onnxruntime"].sources[0]).read_text()
    return int(re.search(r"kApiVersion = (\d+)", text).group(1))


def source_paths(name: str) -> list[Path]:
    """The source files a library compiles from."""
    return [SOURCES / source for source in LIBRARY[name].sources]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- loading -------------------------------------------------------------------------------------
def read_manifest(directory: Path) -> dict | None:
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


# an entry's key -> the type its value must have (kernel_build.build writes them all)
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
    if not target.is_file() or sha256_of(target) != entry.get("sha256"):
        return f"file {target} is missing or not the one built", REINSTALL
    return None


def library_path(name: str) -> Path:
    """The compiled library `name` (a key of LIBRARY), checked against this process and machine."""
    manifest = read_manifest(LIBRARIES)
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
