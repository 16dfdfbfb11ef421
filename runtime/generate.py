"""python -m streamfuse.runtime.generate: run Speculative Streaming (or plain decoding) on prompts.

    python -m streamfuse.runtime.generate --artifact checkpoints/dialogsum-cpu/ss \
        --task dialogsum --input-file ../shared/data/dialogsum/dialogsum.test.jsonl --limit 5 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from streamfuse.runtime.autoregressive import generate_autoregressive
from streamfuse.runtime.backends.base import PruneConfig, prune_config
from streamfuse.runtime.decode import GenerationResult, generate_speculative
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.fallback import FallbackConfig
from streamfuse.runtime.loader import BACKENDS, STREAM_SCHEDULES, Loaded, fastest_backend, load
from streamfuse.runtime.sampling import SamplingConfig
from streamfuse.runtime.trace import Trace
from streamfuse.runtime.tree import TreeSpec

# For checkpoints (artifacts carry their own tree): the chain plus stream 1's second candidate.
# On a CPU with packed kernels it costs what the chain does and was the fastest tree measured
# (1.35x vs 1.23x for the chain, 1.12x for gamma=3,k=2; docs/benchmarks.md).
DEFAULT_TREE = "[[0],[1],[0,0],[0,0,0]]"


@dataclass(frozen=True)
class Request:
    id: str
    text: str  # task source (with --task) or a plain user message


@dataclass(frozen=True)
class DecodeSettings:
    method: str  # "ss" or "ar"
    tree: TreeSpec
    rules: StopRules
    sampling: SamplingConfig
    prune: PruneConfig | None
    seed: int
    fallback: FallbackConfig | None = None  # plain decoding where speculation does not pay (runtime/fallback.py)


def read_requests(path: Path, loaded: Loaded, as_task: bool, limit: int | None) -> Iterator[Request]:
    """JSON lines: with --task, each row gives the task's source fields (e.g. "dialogue") or
    "source"; otherwise each row needs "prompt". Ids come from "id", "fname" or the line number."""
    with Path(path).open(encoding="utf-8") as handle:
        count = 0
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            where = f"{path}:{number}"
            if as_task:
                text = loaded.prompt.fill_source(row, where)
            elif isinstance(row.get("prompt"), str):
                text = row["prompt"]
            else:
                raise ValueError(f"{where}: needs a 'prompt' field (or pass --task to read the task's fields)")
            count += 1
            yield Request(str(row.get("id", row.get("fname", number))), text)


def prompt_ids(loaded: Loaded, text: str, as_task: bool) -> list[int]:
    tokenizer = loaded.tokenizer
    if as_task:
        rendered = loaded.prompt.render(tokenizer, text)
    else:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def run(loaded: Loaded, ids: list[int], settings: DecodeSettings, trace: Trace | None = None,
        run_id: str = "0", on_step=None) -> GenerationResult:
    decode = loaded.tokenizer.decode
    if settings.method == "ar":
        return generate_autoregressive(loaded.backend, ids, settings.rules, settings.sampling, trace, run_id, on_step,
                                       decode, settings.seed)
    return generate_speculative(loaded.backend, ids, settings.tree, settings.rules, settings.sampling, trace, run_id,
                                on_step, settings.prune, decode, settings.seed, settings.fallback)


def result_record(request: Request, loaded: Loaded, result: GenerationResult, settings: DecodeSettings) -> dict:
    run_record = result.run
    return {
        "id": request.id,
        "text": loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip(),
        "token_ids": result.token_ids,
        "model_calls": run_record.model_calls,
        "new_tokens": run_record.new_tokens,
        "call_reduction": run_record.new_tokens / run_record.model_calls,
        "seconds": round(run_record.seconds, 4),
        "tokens_per_second": round(run_record.new_tokens / run_record.seconds, 2) if run_record.seconds else None,
        "stop_reason": result.stop_reason,
        "method": settings.method,
        "backend": loaded.backend.name,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True,
                        help="exported artifact (artifacts/<task>) or fine-tuned checkpoint folder made by export/build.py")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one input: a user message, or the task's source text with --task")
    source.add_argument("--input-file", type=Path, help="JSON lines, one input per line")
    parser.add_argument("--task", help="format inputs with the task prompt the model was fine-tuned with (e.g. dialogsum)")
    parser.add_argument("--limit", type=int, default=None, help="read at most N inputs from --input-file")
    parser.add_argument("--method", choices=("ss", "ar"), default="ss", help="ss: speculative streaming; ar: plain decoding")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="execution engine (default: the fastest the artifact has here, by its calibrations)")
    parser.add_argument("--stream-schedule", choices=STREAM_SCHEDULES, default="fused",
                        help="fused: streams ride along every tree node in one pass (memory-bound devices); "
                             "deferred: streams of the last accepted node only, after verification (CPUs)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--tree", default=None, help="draft tree: 'gamma=G,k=K', a JSON list of paths, or a JSON file "
                        f"(default: the tree calibrated for the backend, else the artifact's, else {DEFAULT_TREE})")
    parser.add_argument("--fallback", choices=("auto", "off"), default="auto",
                        help="auto: decode plainly while speculation does not pay, judged against the step cost "
                             "calibrated for the tree (tools/calibrate.py; off where none was measured)")
    parser.add_argument("--prune-threshold", type=float, default=None, help="prune tree nodes whose early-exit transition probability is below this")
    parser.add_argument("--prune-budget", type=int, default=None, help="keep at most this many non-root tree nodes (by path probability)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples from the target")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--trace", type=Path, default=None, help="write a decode trace (JSON) for tools/profile.py")
    parser.add_argument("--json", action="store_true", help="print one JSON object per input instead of text")
    return parser.parse_args(argv)


def choose_tree(text: str | None, loaded: Loaded) -> TreeSpec:
    """--tree, else the backend's calibrated tree or the artifact's default, else DEFAULT_TREE."""
    if text is not None:
        return TreeSpec.parse(text)
    return loaded.tree if loaded.tree is not None else TreeSpec.parse(DEFAULT_TREE)


def settings_from(args: argparse.Namespace, loaded: Loaded) -> DecodeSettings:
    rules = StopRules(args.max_new_tokens, loaded.stop_token_ids, tuple(args.stop))
    tree = choose_tree(args.tree, loaded)
    fallback = loaded.fallback(tree) if args.fallback == "auto" else None
    return DecodeSettings(args.method, tree, rules, SamplingConfig(args.temperature, args.top_k, args.top_p),
                          prune_config(args.prune_threshold, args.prune_budget), args.seed, fallback)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    StopRules(args.max_new_tokens)  # reject bad limits before the (slow) model load
    backend = args.backend or fastest_backend(args.artifact)
    loaded = load(args.artifact, backend, args.device, args.stream_schedule, args.threads)
    settings = settings_from(args, loaded)
    as_task = args.task is not None
    if as_task and loaded.info.get("task") != args.task:
        raise SystemExit(f"--task {args.task}: {args.artifact} was fine-tuned for {loaded.info.get('task')!r}; "
                         f"use that task name or drop --task")
    if as_task and loaded.prompt is None:
        raise SystemExit(f"--task {args.task}: {args.artifact} records no prompt format; rerun export/build.py "
                         f"(it adds it without retraining) or pass plain prompts without --task")
    requests = [Request("0", args.prompt)] if args.prompt is not None else read_requests(args.input_file, loaded, as_task, args.limit)
    trace = Trace(enabled=args.trace is not None, backend=loaded.backend.name, device=args.device, method=settings.method,
                  num_streams=loaded.backend.num_streams, tree=settings.tree.to_dict() if settings.method == "ss" else None,
                  threads=torch.get_num_threads())
    for request in requests:
        result = run(loaded, prompt_ids(loaded, request.text, as_task), settings, trace, request.id)
        record = result_record(request, loaded, result, settings)
        print(json.dumps(record) if args.json else f"[{record['id']}] {record['text']}\n  ({record['new_tokens']} tokens, "
              f"{record['model_calls']} calls, CR {record['call_reduction']:.2f}, {record['seconds']:.2f} s)", flush=True)
    if args.trace is not None:
        trace.save(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
