"""streamfuse generate: run Speculative Streaming (or plain decoding) on prompts, through the Python API
(runtime/request/api.py), so the command prints what `model.generate` returns.

    streamfuse generate --artifact checkpoints/dialogsum-cpu/ss \
        --task dialogsum --input-file ../shared/data/dialogsum/dialogsum.test.jsonl --limit 5 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from streamfuse.runtime.artifact.prompt import check_text
from streamfuse.runtime.backends.threads import use_threads
from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.options import add_model_options, check_model_options
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.checks import DEFAULT_METHOD, DEFAULT_TREE, DecodeRequest, check_task, decode_settings
from streamfuse.runtime.request.completion import Completion
from streamfuse.runtime.request.frontend import load_model, new_trace
from streamfuse.runtime.request.inputs import Input, prompt_ids, read_input_file, source_overflow
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.settings import DecodeSettings


def result_record(item: Input, model: Model, done: Completion, settings: DecodeSettings) -> dict:
    """One input's JSON line (--json)."""
    stats = done.stats
    return {
        "id": item.id,
        "text": done.text,
        "token_ids": done.token_ids,
        "model_calls": stats.model_calls,
        "new_tokens": stats.new_tokens,
        "call_reduction": stats.tokens_per_call,
        "seconds": round(stats.seconds, 4),
        "tokens_per_second": round(stats.tokens_per_second, 2) if stats.seconds else None,
        "stop_reason": done.stop_reason,
        "method": settings.method,
        "backend": model.loaded.backend.name,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one input: a user message, or the task's source text with --task")
    source.add_argument("--input-file", type=Path, help="JSON lines, one input per line")
    parser.add_argument(
        "--task",
        help="format inputs with the task prompt the model was fine-tuned with (e.g. "
        "dialogsum); on an artifact with several tasks, the task to run",
    )
    parser.add_argument("--limit", type=int, default=None, help="read at most N inputs from --input-file")
    parser.add_argument(
        "--cut-source",
        action="store_true",
        help="with --task: cut a source longer than the model "
        "was fine-tuned on to that length, as training did (default: keep it whole, up to the context)",
    )
    parser.add_argument("--method", choices=registry.names(), default=DEFAULT_METHOD, help=methods_help())
    parser.add_argument(
        "--fallback",
        choices=("auto", "off"),
        default="auto",
        help="auto: decode plainly while speculation does not pay, judged against the step cost "
        "calibrated for the tree (tools/calibrate.py; off where none was measured)",
    )
    parser.add_argument(
        "--prune-threshold",
        type=float,
        default=None,
        help="prune tree nodes whose early-exit transition probability is below this",
    )
    parser.add_argument(
        "--prune-budget",
        type=int,
        default=None,
        help="keep at most this many non-root tree nodes (by path probability)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="specdec++: stop drafting once the predicted "
        "probability of a rejection passes this (default: the artifact's)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples from the target")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--trace", type=Path, default=None, help="write a decode trace (JSON) for tools/profiler.py")
    parser.add_argument("--json", action="store_true", help="print one JSON object per input instead of text")
    add_model_options(
        parser,
        tree=f"the tree calibrated for the backend, else the artifact's, else {DEFAULT_TREE}; "
        "sd: the chain of the length its draft model was built for",
    )
    errors.add_debug_flag(parser)
    return parser.parse_args(argv)


def methods_help() -> str:
    """--method's help: each registered method's line and, where the artifact needs its drafter, the build flags."""
    lines = [
        f"{m.label}" + (f" (streamfuse build {m.build_flags})" if m.build_flags else "")
        for m in map(registry.get, registry.names())
    ]
    return "; ".join(lines)


def request_from(args: argparse.Namespace) -> DecodeRequest:
    """The flags of one generation as the front end takes them."""
    return DecodeRequest(
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        tree=args.tree,
        fallback=args.fallback == "auto",
        prune_threshold=args.prune_threshold,
        prune_budget=args.prune_budget,
        threshold=args.threshold,
    )


def check_flags(args: argparse.Namespace) -> DecodeRequest:
    """Refuse bad values before the (slow) model load -> the request, checked (runtime/request/checks.py)."""
    check_model_options(args)
    errors.check(args.limit is None or args.limit >= 1, f"--limit must be >= 1, got {args.limit}")
    errors.check(args.input_file is None or args.input_file.is_file(), f"--input-file {args.input_file}: no such file")
    if args.prompt is not None:
        errors.usage(lambda: check_text(args.prompt, "--prompt"))  # --input-file's rows: read_input_file's
    request = request_from(args)
    errors.usage(lambda: request.check("--stop"))
    return request


def inputs(args: argparse.Namespace, loaded: Loaded, as_task: bool) -> Iterable[Input]:
    """--prompt, else --input-file's rows."""
    if args.prompt is not None:
        return [Input("0", args.prompt)]
    return read_input_file(args.input_file, loaded, as_task, args.limit)


def warn_overflow(args: argparse.Namespace, loaded: Loaded, item: Input, over: int) -> None:
    fate = (
        "its end is cut"
        if args.cut_source
        else "kept whole (quality past that length is untested; --cut-source cuts it as training did)"
    )
    print(
        f"warning: input {item.id}: the source is {over} tokens over the {loaded.prompt.max_source_tokens} "
        f"the model was fine-tuned on; {fate}",
        file=sys.stderr,
    )


def show(record: dict, as_json: bool) -> None:
    print(
        json.dumps(record)
        if as_json
        else f"[{record['id']}] {record['text']}\n  ({record['new_tokens']} tokens, "
        f"{record['model_calls']} calls, CR {record['call_reduction']:.2f}, {record['seconds']:.2f} s)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    request = check_flags(args)
    loaded = load_model(args.artifact, args.backend, args.device, args.stream_schedule, args.threads, args.task)
    threads = use_threads(args.threads)
    settings = errors.usage(lambda: decode_settings(loaded, request, checked=True))
    as_task = args.task is not None
    if as_task:
        errors.usage(lambda: check_task(loaded, args.task, "--task"))
    trace = new_trace(loaded, settings, args.trace is not None, args.device, threads)
    model = Model(loaded)
    for item in inputs(args, loaded, as_task):
        over = source_overflow(loaded, item.text, as_task, checked=True)  # check_flags, read_input_file
        if over:
            warn_overflow(args, loaded, item, over)
        ids = prompt_ids(loaded, item.text, as_task, cut_source=args.cut_source, checked=True)
        done = model.run(ids, request, trace=trace, run_id=item.id, settings=settings)
        show(
            {**result_record(item, model, done, settings), "source_truncated": bool(over and args.cut_source)},
            args.json,
        )
    if args.trace is not None:
        trace.save(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
