"""streamfuse task-switch: one loaded engine, its artifact's tasks in turn; lossless after each switch.

    streamfuse task-switch --artifact artifacts/dialogsum+e2e_nlg --backends executorch,onnxruntime \
        --limit 100 --threads 2

Per backend, in a fresh process: load the artifact (its own task), then switch to each other task and back to
the own one (Loaded.with_task: the task's tensors bound, nothing loaded again), and after each switch decode the
task's first --limit test inputs with plain decoding and SS (greedy, the task's calibrated tree, interleaved).
Reports the switch time, the RSS above the level after load, SS == plain per task, tokens, and SS's speed-up
over plain decoding in that run. Exit status 1 if SS differs from plain decoding on any input.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.options import add_model_options, check_model_options
from streamfuse.tools.process_memory import child_command


def visit(loaded, task: str, limit: int, max_new_tokens: int) -> tuple[dict, object]:
    """Switch the loaded engine to `task`, then decode its test inputs plainly and with SS."""
    from dataclasses import replace

    from streamfuse.runtime.request.api import Model
    from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD, DecodeRequest, decode_settings
    from streamfuse.runtime.request.inputs import prompt_ids
    from streamfuse.tools.bench_data import read_inputs, task_file
    from streamfuse.tools.process_memory import status, timed_switch

    ar, ss = BASELINE_METHOD, DEFAULT_METHOD
    loaded, switch, rss = timed_switch(loaded, task, status()["VmRSS"])
    speculative = decode_settings(loaded, DecodeRequest(ss, max_new_tokens=max_new_tokens, fallback=False))
    settings = {ar: replace(speculative, method=ar, tree=None), ss: speculative}
    tree = speculative.tree
    inputs = read_inputs(task_file(task, "test"), loaded.prompt, limit)
    seconds, tokens, same = dict.fromkeys(settings, 0.0), 0, 0
    model = Model(loaded)
    for item in inputs:
        ids = prompt_ids(loaded, item.text, True)
        results = {label: model.run(ids, settings=each) for label, each in settings.items()}
        for label, result in results.items():
            seconds[label] += result.record.seconds
        same += results[ss].token_ids == results[ar].token_ids
        tokens += len(results[ar].token_ids)
    return {
        "task": task,
        "switch_seconds": switch,
        "rss_added_bytes": rss,
        "inputs": len(inputs),
        "ss_equals_plain": same,
        "tokens": tokens,
        "tree_nodes": tree.num_nodes,
        "speedup": seconds[ar] / seconds[ss] if seconds[ss] else None,
    }, loaded


def measure_backend(artifact: Path, backend: str, limit: int, threads: int, max_new_tokens: int) -> dict:
    from streamfuse.runtime.request.loader import load
    from streamfuse.tools.process_memory import status

    before = status()["VmRSS"]
    loaded = load(artifact, backend, threads=threads)
    rows, after_load = [], status()["VmRSS"]
    for task in [*loaded.tasks[1:], loaded.tasks[0]]:  # to each other task, then back to the artifact's own
        row, loaded = visit(loaded, task, limit, max_new_tokens)
        rows.append(row)
    return {"backend": backend, "load_bytes": after_load - before, "threads": threads, "visits": rows}


def markdown(results: list[dict]) -> str:
    lines = [
        "| backend | switched to | switch ms | RSS above load (MiB) | inputs | SS == plain | tokens | tree "
        "| SS speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for v in result["visits"]:
            lines.append(
                f"| {result['backend']} | {v['task']} | {1e3 * v['switch_seconds']:.1f} "
                f"| {v['rss_added_bytes'] / 2**20:.1f} | {v['inputs']} | {v['ss_equals_plain']}/{v['inputs']} "
                f"| {v['tokens']} | {v['tree_nodes']} | {v['speedup']:.2f}x |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=100, help="test inputs per task (default %(default)s)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=80, help="(default %(default)s: the cpu preset's longest)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one backend, in a fresh process
    add_model_options(parser, backends="executorch,onnxruntime", threads=2, device=False, schedule=False)
    errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    if min(args.limit, args.threads, args.max_new_tokens) < 1:
        parser.error("--limit, --threads and --max-new-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_model_options(args)  # --threads within this machine's cores, before any load
    if args.child:
        print(json.dumps(measure_backend(args.artifact, args.child, args.limit, args.threads, args.max_new_tokens)))
        return 0
    from streamfuse.runtime.artifact.format import Artifact

    tasks = Artifact.open(args.artifact).tasks
    if len(tasks) < 2:
        raise errors.UsageError(
            f"{args.artifact} serves one task ({tasks[0]}): build several with streamfuse build --task {tasks[0]},OTHER"
        )
    results = []
    for backend in args.backends.split(","):
        command = child_command("streamfuse.tools.task_switch", args, backend)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise errors.UsageError(f"{backend}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    lossless = all(v["ss_equals_plain"] == v["inputs"] for r in results for v in r["visits"])
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(errors.run(main, prog="task_switch"))
