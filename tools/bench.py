"""streamfuse bench: methods x backends x peers on a task split, interleaved.

For each input, every backend runs plain decoding (AR) and Speculative Streaming (SS) back to back
(order alternating per input) and every peer runs once, the order of backends and peers rotating per
input, so drift and background load hit every row alike. SS tokens must equal AR tokens on the same
backend (parity); peers are compared with streamfuse AR on torch. The table gives per row: tokens/s,
speed-up vs AR on the same backend, call reduction CR, mean accepted tokens, TTFT, ROUGE against the
task's references, memory; the machine, versions, threads and load average go beside it.
Writes bench.json, bench.md, tokens_per_s.png, speedup.png and decode traces (trace_<method>.json for
the first backend, trace_<method>_<backend>.json for the others) into --out.

    OMP_WAIT_POLICY=PASSIVE streamfuse bench --artifact artifacts/dialogsum \
        --task dialogsum --split test --limit 100 --backends torch,executorch,onnxruntime \
        --peers hf,hf_pld,llamacpp_f32,llamacpp_f32_pld --threads 2 --out bench/dialogsum-matrix
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

import torch

from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.options import add_model_options, check_model_options
from streamfuse.runtime.measure.timing import summarise
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import DEFAULT_TREE
from streamfuse.runtime.request.loader import BACKENDS, artifact_tasks, load
from streamfuse.tools import bench_report
from streamfuse.tools.bench_data import read_inputs, task_file
from streamfuse.tools.bench_matrix import Engine, Matrix, run_matrix
from streamfuse.tools.bench_setup import load_engines, load_peers
from streamfuse.tools.bench_summary import matched_precision, table
from streamfuse.tools.peer_registry import PEERS

VERSIONED = ("torch", "executorch", "onnxruntime", "onnxruntime-gpu", "coremltools", "transformers", "llama-cpp-python")


def default_backends(artifact: Path) -> str:
    """Every backend the artifact was built for that runs on this machine (a checkpoint: torch), the
    fastest first (by the artifact's calibrations)."""
    from streamfuse.runtime.request.loader import fastest_backend, runnable_backends

    fastest = fastest_backend(artifact)
    return ",".join([fastest, *(b for b in runnable_backends(artifact) if b != fastest)])


def schedule_of(engine: Engine) -> str:
    """Where the benchmarked tree's streams run on this engine (fused or deferred)."""
    backend, tree = engine.loaded.backend, engine.settings[registry.plain()].tree
    return backend.stream_schedule(tree)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="task the model was fine-tuned for (formats the inputs)")
    parser.add_argument(
        "--split",
        default=None,
        help="task split (train, validation, test): finds the task's file "
        "in --data-dir, $STREAMFUSE_DATA_DIR/<task> or ../shared/data/<task>",
    )
    parser.add_argument(
        "--input-file",
        type=Path,
        default=None,
        help="JSON lines (or E2E CSV) with the task's fields; overrides --split",
    )
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="folder holding the task's files (or a <task>/ subfolder)"
    )
    parser.add_argument("--limit", type=int, default=100, help="number of timed inputs (the first N of the file)")
    parser.add_argument(
        "--methods",
        default=f"{registry.plain()},{registry.default()}",
        help=f"streamfuse methods among {', '.join(registry.names())}, {registry.plain()!r} among "
        "them (AR is every speed-up's baseline); the methods other than ar and ss need an artifact "
        "with their drafters (streamfuse build --set sd.enabled=true ...). Variants in the "
        "same run: sd:G / pearl:G (a chain of G drafts), specdec++:H (stop threshold H), "
        "parallelspec:W1-W2-.., falcon:W1-W2-.. and medusa:W1-W2-.. (children per depth), e.g. "
        "ar,sd:2,sd:4,specdec++:0.5",
    )
    parser.add_argument("--peers", default="", help=f"comma-separated peers, run once per input: {', '.join(PEERS)}")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per input and row, interleaved; times are their median"
    )
    parser.add_argument(
        "--fallback",
        choices=("auto", "off"),
        default="auto",
        help="SS decodes plainly while speculation does not pay, against the calibrated step cost "
        "(runtime/speculation/fallback.py; off where the artifact has no calibration for the backend)",
    )
    parser.add_argument("--prune-threshold", type=float, default=None)
    parser.add_argument("--prune-budget", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=2, help="inputs run once, untimed, by every row first")
    parser.add_argument(
        "--n-ctx", type=int, default=0, help="llama.cpp context (0: longest prompt + new tokens, rounded up)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench"), help="folder for bench.json, bench.md, plots and traces"
    )
    add_model_options(
        parser,
        artifact="optional: default artifacts/<task>",
        backends="",
        threads=2,
        tree=f"the backend's calibrated tree, else the artifact's, else {DEFAULT_TREE}",
    )
    parser.epilog = (
        "--backends: BACKEND@FOLDER runs another artifact's backend in the same interleaved run (e.g. "
        "onnxruntime,onnxruntime@artifacts/dialogsum-q4); --threads also sizes llama.cpp's and "
        "ExecuTorch's pools"
    )
    errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    args.artifact = args.artifact or Path("artifacts") / args.task
    args.backends = [b for b in (args.backends or default_backends(args.artifact)).split(",") if b]
    args.methods = [m for m in args.methods.split(",") if m]
    args.peers = [p for p in args.peers.split(",") if p]
    if bad := [b for b in args.backends if b.partition("@")[0] not in BACKENDS]:
        parser.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    if bad := [p for p in args.peers if p not in PEERS]:
        parser.error(f"--peers: unknown {bad}; choose from {', '.join(PEERS)}")
    if registry.plain() not in args.methods or any(not method_label_ok(m) for m in args.methods):
        parser.error(
            f"--methods {','.join(args.methods)}: choose among {', '.join(registry.names())}, "
            f"{registry.plain()!r} included "
            f"(AR is the baseline of every speed-up); variants are sd:G and pearl:G with an integer G >= 1, "
            f"specdec++:H with 0 <= H <= 1 and parallelspec:W1-W2-.. / falcon:W1-W2-.. / medusa:W1-W2-.. "
            f"with whole numbers >= 1"
        )
    if args.input_file is None and args.split is None:
        parser.error("pass --split (with --task) or --input-file")
    if args.repeats < 1 or args.limit < 1 or args.threads < 1 or args.warmup < 0:
        parser.error("--repeats, --limit and --threads must be >= 1, --warmup >= 0")
    return args


def method_label_ok(label: str) -> bool:
    """METHOD, sd:G or specdec++:H (see --methods)."""
    method, colon, value = label.partition(":")
    if method not in registry.names():
        return False
    variant = registry.get(method).variant
    if not colon or variant is None:
        return not colon
    try:
        variant(value)
    except ValueError:
        return False
    return True


def machine() -> dict:
    cpu = platform.processor()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": versions,
        "load_average_start": os.getloadavg(),
    }


def headline(rows: list[dict], rows_table: list[dict], primary: str, methods: list[str]) -> dict:
    """The SS-vs-AR summary of the first backend, plus parity over all backends and the peer comparisons."""
    first = [r for r in rows if r["backend"] == primary]
    summary = summarise(first) if registry.default() in methods else {"inputs": len(first)}
    summary.update(
        primary_backend=primary,
        parity_mismatches=sum(not r.get("same_tokens", True) for r in rows),
        peer_mismatches={r["name"]: r["mismatches"] for r in rows_table if r["kind"] == "peer"},
        matched_precision=matched_precision(rows_table),
        peak_memory_bytes=process_peak_rss_bytes(),
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_model_options(args)  # --threads within this machine's cores, before any load
    torch.set_num_threads(args.threads)
    errors.usage(lambda: StopRules(args.max_new_tokens))  # reject a bad limit before the (slow) model loads
    data = args.input_file or task_file(args.task, args.split, args.data_dir)
    info: dict[str, dict] = {}
    report = {"machine": machine(), "command": "python -m streamfuse.tools.bench " + " ".join(argv or sys.argv[1:])}
    matrix = Matrix(load_engines(args, info), {}, None, args.max_new_tokens, args.repeats)
    primary = matrix.engines[args.backends[0]].loaded
    if primary.info.get("task") != args.task or primary.prompt is None:
        raise errors.UsageError(
            f"--task {args.task}: {args.artifact} was fine-tuned for {primary.info.get('task')!r} "
            f"(prompt format recorded: {primary.prompt is not None})"
        )
    inputs = read_inputs(data, primary.prompt, args.limit)
    skipped = {}
    if args.peers:
        torch_engine = matrix.engines.get("torch")
        matrix.peer_loaded = (
            torch_engine.loaded
            if torch_engine
            else load(
                args.artifact,
                "torch",
                "cpu",
                threads=args.threads,
                task=args.task if args.task in artifact_tasks(args.artifact) else None,
            )
        )
        matrix.peers, skipped = load_peers(args, matrix.peer_loaded, inputs, info)
    try:
        rows, peer_rows = run_matrix(matrix, inputs, args.warmup)
    finally:
        for runner in matrix.peers.values():
            runner.close()
    report["machine"]["load_average_end"] = os.getloadavg()
    report["settings"] = {
        "task": args.task,
        "split": args.split,
        "data": str(data),
        "backends": args.backends,
        "methods": args.methods,
        "peers": list(matrix.peers),
        "device": args.device,
        "threads": args.threads,
        # torch: the flag; exported graphs: the schedule of the tree's greedy_step
        "stream_schedule": {b: schedule_of(e) for b, e in matrix.engines.items()},
        "trees": {b: e.settings[registry.plain()].tree.to_dict()["paths"] for b, e in matrix.engines.items()},
        "tree_nodes": {b: e.settings[registry.plain()].tree.num_nodes for b, e in matrix.engines.items()},
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "prune": {"threshold": args.prune_threshold, "budget": args.prune_budget},
    }
    report["skipped"] = skipped
    report["peer_info"] = {name: runner.info() for name, runner in matrix.peers.items()}
    report["table"] = table(rows, peer_rows, inputs, args.methods, info)
    report["summary"] = headline(rows, report["table"], args.backends[0], args.methods)
    report["rows"], report["peer_rows"] = rows, peer_rows
    for backend, engine in matrix.engines.items():
        for method, trace in engine.traces.items():
            label = backend.replace("@", "-").replace("/", "_")
            trace.save(
                args.out / (f"trace_{method}.json" if backend == args.backends[0] else f"trace_{method}_{label}.json")
            )
    bench_report.write_report(report, args.out)
    print(bench_report.markdown(report))
    return 0 if report["summary"]["parity_mismatches"] == 0 else 1


if __name__ == "__main__":
    start = time.perf_counter()
    code = errors.run(main, prog="bench")
    print(f"[bench] {time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(code)
