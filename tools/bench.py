"""python -m streamfuse.tools.bench: Speculative Streaming vs plain decoding, interleaved.

Each input runs both methods back to back on the same backend (the order alternates per input,
so drift and thermal effects hit both alike), checks that the speculative tokens equal the plain
ones, and records time, calls and tokens. Figures are medians and same-run ratios; the machine,
threads and load average are written next to them.

    OMP_WAIT_POLICY=PASSIVE python -m streamfuse.tools.bench --artifact checkpoints/dialogsum-cpu/ss \
        --task dialogsum --input-file ../shared/data/dialogsum/dialogsum.test.jsonl --limit 100 --threads 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: spin-waiting threads distort CPU timings

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from streamfuse.runtime.emitter import StopRules  # noqa: E402
from streamfuse.runtime.generate import DecodeSettings, prompt_ids, read_requests, run  # noqa: E402
from streamfuse.runtime.loader import BACKENDS, STREAM_SCHEDULES, load  # noqa: E402
from streamfuse.runtime.backends.base import prune_config  # noqa: E402
from streamfuse.runtime.sampling import SamplingConfig  # noqa: E402
from streamfuse.runtime.trace import Trace  # noqa: E402
from streamfuse.runtime.tree import TreeSpec  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="checkpoint folder made by export/build.py")
    parser.add_argument("--task", required=True, help="task the model was fine-tuned for (formats the inputs)")
    parser.add_argument("--input-file", type=Path, required=True, help="JSON lines with the task's fields")
    parser.add_argument("--limit", type=int, default=100, help="number of inputs")
    parser.add_argument("--backend", choices=BACKENDS, default="torch")
    parser.add_argument("--stream-schedule", choices=STREAM_SCHEDULES, default="fused",
                        help="fused: streams ride along every tree node in one pass (memory-bound devices); "
                             "deferred: streams of the last accepted node only, after verification (CPUs)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="fixed torch CPU threads")
    parser.add_argument("--tree", default="gamma=3,k=2", help="draft tree: 'gamma=G,k=K' or a JSON list of paths")
    parser.add_argument("--prune-threshold", type=float, default=None)
    parser.add_argument("--prune-budget", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--warmup", type=int, default=2, help="untimed inputs run first")
    parser.add_argument("--out", type=Path, default=Path("bench"), help="folder for bench.json, bench.md and traces")
    return parser.parse_args(argv)


def machine() -> dict:
    cpu = platform.processor()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "load_average_start": os.getloadavg()}


def summarise(rows: list[dict]) -> dict:
    ar_s = sum(r["ar"]["seconds"] for r in rows)
    ss_s = sum(r["ss"]["seconds"] for r in rows)
    tokens = sum(r["ss"]["new_tokens"] for r in rows)
    return {
        "inputs": len(rows),
        "parity_mismatches": sum(not r["same_tokens"] for r in rows),
        "new_tokens": tokens,
        "call_reduction": tokens / sum(r["ss"]["model_calls"] for r in rows),
        "speedup_total_time": ar_s / ss_s,
        "speedup_median_per_input": statistics.median(r["ar"]["seconds"] / r["ss"]["seconds"] for r in rows),
        "ar_tokens_per_s_median": statistics.median(r["ar"]["new_tokens"] / r["ar"]["seconds"] for r in rows),
        "ss_tokens_per_s_median": statistics.median(r["ss"]["new_tokens"] / r["ss"]["seconds"] for r in rows),
        "ar_ttft_s_median": statistics.median(r["ar"]["prefill_s"] for r in rows),
        "ss_ttft_s_median": statistics.median(r["ss"]["prefill_s"] for r in rows),
        "ss_mean_tokens_per_step": statistics.mean(t for r in rows for t in r["ss"]["step_tokens"]) if tokens else 0.0,
        "peak_memory_bytes": max((r["ss"]["peak_memory_bytes"] or 0) for r in rows),
    }


def markdown(report: dict) -> str:
    s, m, cfg = report["summary"], report["machine"], report["settings"]
    return "\n".join([
        f"## {cfg['task']}: SS vs plain decoding, {cfg['backend']} {cfg['device']}, {s['inputs']} inputs, greedy",
        "",
        f"Machine: {m['cpu']}, {m['threads']} threads, OMP_WAIT_POLICY={m['omp_wait_policy']}, "
        f"load average {m['load_average_start'][0]:.2f} at start / {m['load_average_end'][0]:.2f} at end; "
        f"torch {m['torch']}. Tree {cfg['tree']} ({cfg['tree_nodes']} nodes), {cfg['stream_schedule']} streams, "
        f"max {cfg['max_new_tokens']} new tokens.",
        "",
        "| metric | value |", "|---|---:|",
        f"| call reduction CR (tokens / SS model calls, prefill counted) | {s['call_reduction']:.2f} |",
        f"| mean tokens per verify step | {s['ss_mean_tokens_per_step']:.2f} |",
        f"| wall-clock speed-up (total AR time / total SS time) | {s['speedup_total_time']:.2f}x |",
        f"| wall-clock speed-up (median per input) | {s['speedup_median_per_input']:.2f}x |",
        f"| AR tokens/s (median) | {s['ar_tokens_per_s_median']:.1f} |",
        f"| SS tokens/s (median) | {s['ss_tokens_per_s_median']:.1f} |",
        f"| time to first token AR / SS (median, s) | {s['ar_ttft_s_median']:.3f} / {s['ss_ttft_s_median']:.3f} |",
        f"| SS output != AR output (inputs) | {s['parity_mismatches']} |",
        f"| peak process memory | {s['peak_memory_bytes'] / 2**20:.0f} MiB |",
        "",
        f"Command: `{report['command']}`",
    ])


def measure(loaded, ids, settings, trace, run_id) -> dict:
    result = run(loaded, ids, settings, trace, run_id)
    record = result.run
    return {"seconds": record.seconds, "new_tokens": record.new_tokens, "model_calls": record.model_calls,
            "prefill_s": record.spans["prefill"], "step_tokens": [s.tokens for s in record.steps],
            "peak_memory_bytes": record.peak_memory_bytes, "token_ids": result.token_ids}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load(args.artifact, args.backend, args.device, args.stream_schedule)
    tree = TreeSpec.parse(args.tree)
    prune = prune_config(args.prune_threshold, args.prune_budget)
    rules = StopRules(args.max_new_tokens, loaded.stop_token_ids)
    ss = DecodeSettings("ss", tree, rules, SamplingConfig(), prune, 0)
    ar = replace(ss, method="ar")
    meta = dict(backend=loaded.backend.name, device=args.device, num_streams=loaded.backend.num_streams,
                threads=args.threads)
    traces = {"ss": Trace(method="ss", tree=tree.to_dict(), **meta), "ar": Trace(method="ar", tree=None, **meta)}
    requests = list(read_requests(args.input_file, loaded, True, args.limit + args.warmup))
    report = {"machine": machine(), "command": "python -m streamfuse.tools.bench " + " ".join(argv or sys.argv[1:]),
              "settings": {"task": args.task, "backend": args.backend, "device": args.device, "tree": args.tree,
                           "tree_nodes": tree.num_nodes, "max_new_tokens": args.max_new_tokens,
                           "stream_schedule": args.stream_schedule,
                           "prune": {"threshold": args.prune_threshold, "budget": args.prune_budget} if prune else None}}
    rows = []
    for index, request in enumerate(tqdm(requests, desc="bench", unit="input", dynamic_ncols=True)):
        ids = prompt_ids(loaded, request.text, True)
        warm = index < args.warmup
        order = ("ar", "ss") if index % 2 == 0 else ("ss", "ar")
        results = {}
        for method in order:
            settings = ss if method == "ss" else ar
            results[method] = measure(loaded, ids, settings, Trace(enabled=False) if warm else traces[method], request.id)
        if not warm:
            rows.append({"id": request.id, "prompt_tokens": len(ids), **results,
                         "same_tokens": results["ss"]["token_ids"] == results["ar"]["token_ids"]})
    report["machine"]["load_average_end"] = os.getloadavg()
    report["summary"] = summarise(rows)
    report["rows"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    for name, trace in traces.items():
        trace.save(args.out / f"trace_{name}.json")
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    (args.out / "bench.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0 if report["summary"]["parity_mismatches"] == 0 else 1


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"[bench] {time.perf_counter() - start:.0f} s", file=sys.stderr)
    sys.exit(code)
