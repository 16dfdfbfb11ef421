"""Memory an engine costs: RSS added when the runtime opens an artifact's backend, and the peak
while it decodes, each backend in a fresh process (no pages freed by another engine to reuse, no
other engine's libraries counted).

    streamfuse memory --artifact artifacts/dialogsum --backends executorch,onnxruntime \\
        --task dialogsum --split test --limit 3 --threads 2

Per backend: the bytes of its files in the artifact (weights and graphs, and the loaded task's
tensors where the graphs take them as inputs); the RSS `load()` adds, split into anonymous memory
(what a phone cannot page out) and file-backed pages (mapped weights, which the OS may drop); of it, the tokenizer
(measured on its own) and the host's KV cache (its resident pages: the host allocates all C slots, and a page
becomes resident when a row is first written into it), and the rest, the engine, against the file bytes; the
KV cache's resident pages after decoding, and the peak RSS above the level before `load()` while the inputs
decode plainly and with SS (greedy). On an artifact with several
tasks, the time to switch the loaded engine to each other task and back, and the RSS each switch leaves
above the one-task level. Linux only: it reads /proc.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from streamfuse.runtime.commands.options import add_model_options, check_model_options  # argparse only: measured clean
from streamfuse.tools.process_memory import cache_resident_bytes, child_command, status, timed_switch

MIB = 2**20


def measure_backend(
    artifact: Path, backend: str, data: Path | None, limit: int, threads: int, max_new_tokens: int
) -> dict:
    """In this (fresh) process: load the backend, then decode the inputs plainly and with SS."""
    import importlib

    from streamfuse.runtime.artifact.format import Artifact
    from streamfuse.runtime.request.api import Model
    from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD, DecodeRequest, decode_settings
    from streamfuse.runtime.request.inputs import prompt_ids
    from streamfuse.runtime.request.loader import load
    from streamfuse.tools.bench_data import read_inputs

    opened = Artifact.open(artifact)
    importlib.import_module({"executorch": "executorch.runtime", "onnxruntime": "onnxruntime"}.get(backend, "torch"))
    tokenizers = [opened.load_tokenizer()]  # the first also imports what tokenizers need
    before_tokenizer = status()
    tokenizers.append(opened.load_tokenizer())  # kept alive: its pages are not free for load() to reuse
    before = status()
    loaded = load(artifact, backend, threads=threads)
    after, cache_at_load = status(), cache_resident_bytes(loaded.backend)
    inputs = read_inputs(data, loaded.prompt, limit) if data is not None else []
    settings = [
        decode_settings(loaded, DecodeRequest(method, max_new_tokens, fallback=False))
        for method in (BASELINE_METHOD, DEFAULT_METHOD)
    ]
    model = Model(loaded)
    for item in inputs:
        ids = prompt_ids(loaded, item.text, as_task=True)
        for each in settings:
            model.run(ids, settings=each)
    end = status()
    switches = switch_tasks(loaded, opened, backend) if len(opened.tasks) > 1 else []
    files = opened.backend_files(backend)
    task_file = opened.manifest["task_files"].get(backend)  # graphs without the task: its tensors are bound beside
    return {
        "backend": backend,
        "file_bytes": sum(p.stat().st_size for p in files.values()) + (task_file["bytes"] if task_file else 0),
        "kv_cache_bytes": cache_at_load,
        "kv_cache_decoded_bytes": cache_resident_bytes(loaded.backend),
        "kv_cache_allocated_bytes": loaded.backend.keys.nbytes + loaded.backend.values.nbytes,
        "load_bytes": after["VmRSS"] - before["VmRSS"],
        "load_anon_bytes": after["RssAnon"] - before["RssAnon"],
        "load_file_bytes": after["RssFile"] - before["RssFile"],
        "tokenizer_bytes": before["VmRSS"] - before_tokenizer["VmRSS"],
        "decode_peak_bytes": end["VmHWM"] - before["VmRSS"] if inputs else None,
        "inputs": len(inputs),
        "threads": threads,
        "switches": switches,
    }


def switch_tasks(loaded, opened, backend: str) -> list[dict]:
    """Switch the loaded engine to each other task of the artifact and back to its own: seconds per switch (reading
    and checking the task's file, binding its tensors) and the RSS it leaves against the one-task level after load."""
    level, rows = status()["VmRSS"], []
    for task in [*opened.tasks[1:], opened.tasks[0]]:
        loaded, seconds, rss = timed_switch(loaded, task, level)
        entry = opened.for_task(task).manifest["task_files"].get(backend)
        rows.append(
            {
                "task": task,
                "seconds": seconds,
                "rss_added_bytes": rss,
                "task_file_bytes": entry["bytes"] if entry else None,
            }
        )
    return rows


def engine_bytes(row: dict) -> int:
    """What the engine itself holds: load()'s growth less the tokenizer and the host's KV cache."""
    return row["load_bytes"] - row["tokenizer_bytes"] - row["kv_cache_bytes"]


def markdown(rows: list[dict]) -> str:
    mib = lambda value: "-" if value is None else f"{value / MIB:.0f}"  # noqa: E731
    lines = [
        "| backend | artifact files (MiB) | RSS added by load() | anonymous | file-backed | of which tokenizer "
        "| of which KV cache | the engine: the rest | engine / files | KV cache after decoding (of allocated) "
        "| peak while decoding, above pre-load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        engine = engine_bytes(r)
        lines.append(
            f"| {r['backend']} | {mib(r['file_bytes'])} | {mib(r['load_bytes'])} | {mib(r['load_anon_bytes'])} "
            f"| {mib(r['load_file_bytes'])} | {mib(r['tokenizer_bytes'])} | {mib(r['kv_cache_bytes'])} "
            f"| {mib(engine)} | {engine / r['file_bytes']:.2f}x "
            f"| {mib(r['kv_cache_decoded_bytes'])} ({mib(r['kv_cache_allocated_bytes'])}) "
            f"| {mib(r['decode_peak_bytes'])} |"
        )
    switches = [(r["backend"], s) for r in rows for s in r.get("switches", [])]
    if switches:
        lines += [
            "",
            "| backend | switch to task | ms | RSS above one task loaded (MiB) | task's file (MiB) |",
            "|---|---|---:|---:|---:|",
        ]
        lines += [
            f"| {backend} | {s['task']} | {1e3 * s['seconds']:.1f} | {mib(s['rss_added_bytes'])} "
            f"| {mib(s['task_file_bytes'])} |"
            for backend, s in switches
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default=None, help="decode this task's inputs after loading (e.g. dialogsum)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=3, help="inputs to decode (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one backend, in a fresh process
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    add_model_options(parser, backends="executorch,onnxruntime", threads=2, device=False, schedule=False)
    parser.epilog = "--backends: those the artifact was not built for are skipped"
    return parser.parse_args(argv)


def _child_command(args: argparse.Namespace, backend: str, data: Path | None) -> list[str]:
    command = child_command("streamfuse.tools.memory", args, backend)
    return command + (["--data", str(data)] if data is not None else [])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_model_options(args)  # --threads within this machine's cores, before any load
    if not sys.platform.startswith("linux"):
        print(f"error: tools.memory reads /proc (Linux); this is {sys.platform}", file=sys.stderr)
        return 2
    if args.child:
        from streamfuse.runtime.backends.runners import MissingBackend

        try:
            row = measure_backend(args.artifact, args.child, args.data, args.limit, args.threads, args.max_new_tokens)
        except MissingBackend as error:  # e.g. Core ML off macOS: a skip with its reason, not a failure
            row = {"backend": args.child, "skipped": str(error)}
        print(json.dumps(row))
        return 0
    from streamfuse.runtime.artifact.format import Artifact, ArtifactError
    from streamfuse.runtime.request.loader import EXPORTED_BACKENDS
    from streamfuse.tools.bench_data import task_file
    from streamfuse.tools.bench_report import write_atomic

    try:
        built = Artifact.open(args.artifact).manifest["files"]
        data = task_file(args.task, args.split) if args.task else None
    except (ArtifactError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.limit < 1 or args.threads < 1 or args.max_new_tokens < 1:
        print("error: --limit, --threads and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    backends = args.backends.split(",")
    unknown = [b for b in backends if b not in EXPORTED_BACKENDS]
    if unknown:
        print(
            f"error: --backends {','.join(unknown)}: not an exported backend (choose from "
            f"{', '.join(EXPORTED_BACKENDS)})",
            file=sys.stderr,
        )
        return 2
    rows = []
    for backend in backends:
        if backend not in built:
            print(f"[memory] {backend}: not in {args.artifact} (built: {', '.join(built)}); skipped", file=sys.stderr)
            continue
        result = subprocess.run(_child_command(args, backend, data), capture_output=True, text=True)
        if result.returncode != 0:
            print(f"error: measuring {backend} failed: {result.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        row = json.loads(result.stdout.strip().splitlines()[-1])
        if "skipped" in row:
            print(f"[memory] {backend}: skipped: {row['skipped']}", file=sys.stderr)
            continue
        rows.append(row)
    if not rows:
        print(f"error: none of {args.backends} runs here from {args.artifact}", file=sys.stderr)
        return 1
    print(markdown(rows))
    if args.out is not None:
        write_atomic(args.out, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
