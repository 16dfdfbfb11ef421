"""llama.cpp built from source as its own users build it, for tools/peers_native.py.

Source: the llama.cpp copy vendored in the llama-cpp-python sdist of the installed version (else the version
pinned in the `bench` extra), fetched once with `pip download --no-binary`, or --llama-cpp-dir. It is built with
cmake and llama.cpp's own defaults (Release, GGML_NATIVE, OpenMP) into <cache>/llama.cpp-<version>/build
($STREAMFUSE_CACHE or ~/.cache/streamfuse): resumable, and used only once build.json is there (written last).
The peers' environment (`clean_env`) drops every OMP_* / GOMP_* / KMP_* variable, so llama.cpp's OpenMP threads
spin as they do for its users.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from streamfuse.runtime.artifact.durable import replace_folder
from streamfuse.tools.peers_gguf import cache_root, llama_cpp_sdist, llama_cpp_version

TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
# llama.cpp's defaults; LLAMA_CURL=OFF keeps older versions off libcurl (0.3.36's llama.cpp ignores it)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF")
# --no-amx: llama.cpp's AMX kernels (compiled in by GGML_NATIVE's -march=native on CPUs with AMX) crash on some
# machines (SIGSEGV / SIGILL in ggml_backend_amx_mul_mat, llama.cpp#20824); explicit -mno-* win over -march=native
# in GCC and clang, so this drops the AMX buffer type only and keeps every other native kernel (and CPU_REPACK).
NO_AMX_FLAGS = tuple(f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX"))
# SOURCE_DATE_EPOCH turns llama.cpp's GGML_NATIVE default off: it is not passed to cmake
BUILD_ENV_DROP = ("SOURCE_DATE_EPOCH",)
CACHE_KEYS = (
    "CMAKE_BUILD_TYPE",
    "CMAKE_C_COMPILER",
    "CMAKE_CXX_COMPILER",
    "BUILD_SHARED_LIBS",
    "GGML_NATIVE",
    "GGML_OPENMP",
    "OpenMP_C_FLAGS",
    "GGML_CPU",
    "GGML_BLAS",
    "GGML_LLAMAFILE",
    "GGML_CPU_REPACK",
)
OPENMP_PREFIXES = ("OMP_", "GOMP_", "KMP_")


def log(message: str) -> None:
    print(f"[peers_native] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- environment


def clean_env(base: dict | None = None, passive: bool = False) -> dict:
    """The peer's environment: `base` (os.environ) without OMP_* / GOMP_* / KMP_* (`import streamfuse` sets
    OMP_WAIT_POLICY=PASSIVE; llama.cpp sets its own KMP_BLOCKTIME unless one is inherited); with passive,
    OMP_WAIT_POLICY=PASSIVE alone is put back."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(OPENMP_PREFIXES)}
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def env_diff(parent: dict, child: dict) -> dict:
    removed = {k: v for k, v in parent.items() if k not in child}
    added = {k: v for k, v in child.items() if parent.get(k) != v}
    return {"removed": removed, "added_or_changed": added}


def output(cmd: list[str], env: dict | None = None) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


# ---------------------------------------------------------------- llama.cpp source


def pinned_version() -> str:
    """llama-cpp-python's version: the installed one, else the `bench` extra's pin in pyproject.toml."""
    version = llama_cpp_version()
    if version:
        return version
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    found = re.search(r'"llama-cpp-python==([\w.]+)"', pyproject.read_text()) if pyproject.is_file() else None
    return found.group(1) if found else "0.3.36"


def source_tree(llama_cpp_dir: str | None, version: str) -> Path:
    if llama_cpp_dir:
        folder = Path(llama_cpp_dir).expanduser().resolve()
        if not (folder / "tools" / "llama-bench").is_dir() or not (folder / "CMakeLists.txt").is_file():
            raise SystemExit(f"error: --llama-cpp-dir {folder} is not a llama.cpp source tree (no tools/llama-bench)")
        return folder
    target = cache_root() / f"llama.cpp-{version}" / "src"
    if not (target / "CMakeLists.txt").is_file():
        _fetch_source(version, target)
    return target


def _fetch_source(version: str, target: Path) -> None:
    log(f"fetching the llama-cpp-python {version} sdist for its vendored llama.cpp (once) -> {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            archive_path = llama_cpp_sdist(version, Path(tmp))
        except FileNotFoundError as error:
            raise SystemExit(f"error: {error}") from None
        staging = Path(tmp) / "src"
        _extract_vendor(archive_path, staging)
        if not (staging / "CMakeLists.txt").is_file():
            raise SystemExit(f"error: {archive_path.name} has no vendor/llama.cpp/CMakeLists.txt")
        replace_folder(staging, target)  # the old copy deleted once the new one is in place


def _extract_vendor(archive_path: Path, staging: Path) -> None:
    with tarfile.open(archive_path) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/vendor/llama.cpp/", 1)
            # the submodule's .git file points into a checkout we do not have: git would fail on it
            if len(parts) == 2 and parts[1] != ".git" and (member.isfile() or member.isdir()):
                member.name = parts[1]
                archive.extract(member, staging, filter="data")


# ---------------------------------------------------------------- build


def build_dir_for(source: Path, version: str, llama_cpp_dir: str | None, no_amx: bool = False) -> Path:
    name = "build-noamx" if no_amx else "build"
    if llama_cpp_dir:
        key = hashlib.sha256(str(source).encode()).hexdigest()[:12]
        return cache_root() / f"llama.cpp-local-{key}" / name
    return cache_root() / f"llama.cpp-{version}" / name


def check_toolchain() -> dict:
    cmake = shutil.which("cmake")
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    cxx = next(filter(None, map(shutil.which, compilers)), None)
    if not cmake:
        raise SystemExit("error: cmake not found on PATH: install it (apt-get install cmake, or pip install cmake)")
    if not cxx:
        raise SystemExit("error: no C++ compiler found (CXX, c++, g++, clang++): install one (apt-get install g++)")
    return {"cmake": cmake, "cmake_version": output([cmake, "--version"]).splitlines()[0:1], "cxx": cxx}


def binaries(build: Path) -> dict[str, Path]:
    return {target: build / "bin" / target for target in TARGETS}


def ensure_build(source: Path, build: Path, version: str, flags: tuple[str, ...] = CMAKE_FLAGS) -> dict:
    """Configure and build TARGETS once; a build counts only when build.json (written last) is there."""
    stamp = build / "build.json"
    if stamp.is_file() and all(path.is_file() for path in binaries(build).values()):
        return json.loads(stamp.read_text())
    toolchain = check_toolchain()
    env = build_env(source)
    build.mkdir(parents=True, exist_ok=True)
    configure = [toolchain["cmake"], "-S", str(source), "-B", str(build), *flags]
    compile_ = [toolchain["cmake"], "--build", str(build), "--config", "Release", "-j", "2", "--target", *TARGETS]
    for step, cmd in (("configure", configure), ("build", compile_)):
        log(f"{step}: {' '.join(cmd)}  (minutes, once)")
        _run_step(cmd, env, build / f"{step}.log")
    info = {
        "llama_cpp_python_version": version,
        "source": str(source),
        "build": str(build),
        "configure_command": configure,
        "build_command": compile_,
        "cmake_flags": list(flags),
        "env": env_diff(dict(os.environ), env),
        **toolchain,
        "cmake_cache": cmake_cache(build / "CMakeCache.txt"),
        "compiler_version": compiler_version(build),
        "configure_notes": configure_notes(build / "configure.log"),
    }
    staging = stamp.with_suffix(".tmp")
    staging.write_text(json.dumps(info, indent=1))
    staging.replace(stamp)
    return info


def build_env(source: Path) -> dict:
    """cmake's environment: clean_env() without BUILD_ENV_DROP; git (build-info) stops at the source tree, so a
    cache inside another repository never lends that repository's commit to the build."""
    env = {k: v for k, v in clean_env().items() if k not in BUILD_ENV_DROP}
    env["GIT_CEILING_DIRECTORIES"] = str(source.parent)
    return env


def _run_step(cmd: list[str], env: dict, log_path: Path) -> None:
    """Runs cmd streaming its lines (progress) to stderr and to log_path; a failure is one SystemExit line."""
    with (
        open(log_path, "w") as sink,
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            sink.write(line)
            if line.startswith("[") or "error" in line.lower():
                print(f"  {line.rstrip()[:160]}", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {Path(cmd[0]).name} {cmd[1]} failed ({proc.returncode}); see {log_path}")


def cmake_cache(path: Path) -> dict:
    values = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, _, value = line.partition("=")
        key = name.split(":", 1)[0]
        if key in CACHE_KEYS:
            values[key] = value
    return values


def configure_notes(log_path: Path) -> list[str]:
    """The configure lines that say what llama.cpp chose: OpenMP, the CPU backend's -march, the build type."""
    keep = ("OpenMP", "CPU backend variant", "CMAKE_BUILD_TYPE", "GGML_SYSTEM_ARCH", "Git")
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    return [line.strip("- ").strip() for line in lines if any(word in line for word in keep)]


def compiler_version(build: Path) -> dict:
    cache = cmake_cache(build / "CMakeCache.txt")
    return {
        lang: output([cache[key], "--version"]).split("\n", 1)[0]
        for lang, key in (("c", "CMAKE_C_COMPILER"), ("cxx", "CMAKE_CXX_COMPILER"))
        if cache.get(key)
    }


def library_system_info(build: Path) -> str:
    """llama_print_system_info() of the built libllama (llama-bench and llama-batched-bench print none in 0.3.36's
    llama.cpp), read in a child process with the peers' environment."""
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.llama_print_system_info.restype = ctypes.c_char_p;"
        " print(lib.llama_print_system_info().decode())"
    )
    return output([sys.executable, "-I", "-c", code, str(build / "bin" / "libllama.so")], env=clean_env()).strip()


def batched_jsonl_supported(source: Path) -> bool:
    arg = source / "common" / "arg.cpp"
    return arg.is_file() and "batched_bench_output_jsonl" in arg.read_text(errors="replace")


def last_line(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
