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

from streamfuse.runtime import cli, methods
from streamfuse.runtime.backends.base import prune_config
from streamfuse.runtime.decode import GenerationResult, generate
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.loader import Loaded, artifact_tasks, fastest_backend, load
from streamfuse.runtime.options import add_model_options, check_model_options
from streamfuse.runtime.prompt import check_text
from streamfuse.runtime.sampling import SamplingConfig
from streamfuse.runtime.settings import DecodeSettings
from streamfuse.runtime.threads import use_threads
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


def read_requests(path: Path, loaded: Loaded, as_task: bool, limit: int | None) -> Iterator[Request]:
    """JSON lines: with --task, each row gives the task's source fields (e.g. "dialogue") or
    "source"; otherwise each row needs "prompt". Ids come from "id", "fname" or the line number.
    A file with no input is an error, not an empty run."""
    with Path(path).open("rb") as handle:
        count = 0
        for number, raw in enumerate(handle, 1):
            if limit is not None and count >= limit:
                return
            where = f"{path}:{number}"
            row = _json_row(raw, where)
            if row is None:
                continue
            if as_task:
                text = loaded.prompt.fill_source(row, where)
            elif isinstance(row.get("prompt"), str):
                text = check_text(row["prompt"], f"{where}: the prompt")
            else:
                raise ValueError(f"{where}: needs a 'prompt' field (or pass --task to read the task's fields)")
            count += 1
            yield Request(str(row.get("id", row.get("fname", number))), text)
    if count == 0:
        raise ValueError(f"--input-file {path}: no inputs (one JSON object per line)")


def _json_row(raw: bytes, where: str) -> dict | None:
    """One line's JSON object; None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where}: not UTF-8 text ({error.reason} at byte {error.start}): save the file as "
                         f"UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a line must be one JSON object, got {type(row).__name__}")
    return row


def source_overflow(loaded: Loaded, text: str, as_task: bool) -> int:
    """How many of a task source's tokens the prompt cuts off (as training did); 0 when it fits."""
    if not as_task:
        return 0
    return loaded.prompt.overflow(loaded.tokenizer, text)


def prompt_ids(loaded: Loaded, text: str, as_task: bool, cut_source: bool = True) -> list[int]:
    """Token ids of a request; a task source is cut as training cut it unless cut_source is False."""
    tokenizer = loaded.tokenizer
    check_text(text, "the prompt")
    if as_task:
        rendered = loaded.prompt.render(tokenizer, text, cut=cut_source)
    else:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def run(loaded: Loaded, ids: list[int], settings: DecodeSettings, trace: Trace | None = None,
        run_id: str = "0", on_step=None) -> GenerationResult:
    return generate(loaded.backend, ids, settings, drafter=loaded.drafter(settings), trace=trace, run_id=run_id,
                    on_step=on_step, decode=loaded.tokenizer.decode)


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
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one input: a user message, or the task's source text with --task")
    source.add_argument("--input-file", type=Path, help="JSON lines, one input per line")
    parser.add_argument("--task", help="format inputs with the task prompt the model was fine-tuned with (e.g. dialogsum); "
                                       "on an artifact with several tasks, the task to run")
    parser.add_argument("--limit", type=int, default=None, help="read at most N inputs from --input-file")
    parser.add_argument("--cut-source", action="store_true", help="with --task: cut a source longer than the model "
                        "was fine-tuned on to that length, as training did (default: keep it whole, up to the context)")
    parser.add_argument("--method", choices=methods.names(), default="ss", help=methods_help())
    parser.add_argument("--fallback", choices=("auto", "off"), default="auto",
                        help="auto: decode plainly while speculation does not pay, judged against the step cost "
                             "calibrated for the tree (tools/calibrate.py; off where none was measured)")
    parser.add_argument("--prune-threshold", type=float, default=None, help="prune tree nodes whose early-exit transition probability is below this")
    parser.add_argument("--prune-budget", type=int, default=None, help="keep at most this many non-root tree nodes (by path probability)")
    parser.add_argument("--threshold", type=float, default=None, help="specdec++: stop drafting once the predicted "
                        "probability of a rejection passes this (default: the artifact's)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="stop after this many new tokens")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples from the target")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--trace", type=Path, default=None, help="write a decode trace (JSON) for tools/profiler.py")
    parser.add_argument("--json", action="store_true", help="print one JSON object per input instead of text")
    add_model_options(parser, tree=f"the tree calibrated for the backend, else the artifact's, else {DEFAULT_TREE}; "
                                   "sd: the chain of the length its draft model was built for")
    cli.add_debug_flag(parser)
    return parser.parse_args(argv)


def methods_help() -> str:
    """--method's help: each registered method's line and, where the artifact needs its drafter, the build flags."""
    lines = [f"{m.label}" + (f" (export/build.py {m.build_flags})" if m.build_flags else "")
             for m in map(methods.get, methods.names())]
    return "; ".join(lines)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad values before the (slow) model load."""
    check_model_options(args)
    cli.check(args.limit is None or args.limit >= 1, f"--limit must be >= 1, got {args.limit}")
    cli.check(args.input_file is None or args.input_file.is_file(), f"--input-file {args.input_file}: no such file")
    cli.usage(lambda: StopRules(args.max_new_tokens))
    cli.usage(lambda: SamplingConfig(args.temperature, args.top_k, args.top_p))
    cli.usage(lambda: prune_config(args.prune_threshold, args.prune_budget))
    cli.check(args.threshold is None or 0.0 <= args.threshold <= 1.0,
              f"--threshold is a probability in [0, 1], got {args.threshold}")
    if args.tree is not None:
        cli.usage(lambda: TreeSpec.parse(args.tree))
    if args.prompt is not None:
        cli.usage(lambda: check_text(args.prompt, "--prompt"))
    for stop in args.stop:
        cli.usage(lambda: check_text(stop, "--stop"))


def choose_tree(text: str | None, loaded: Loaded, method: str = "ss") -> TreeSpec:
    """--tree, else the method's own (ss: the backend's calibrated tree or the artifact's default, else
    DEFAULT_TREE; sd: its draft model's chain; specdec++: its longest chain; ss-adaptive: the largest
    calibrated tree, the bound of its choice)."""
    if text is not None:
        return TreeSpec.parse(text, loaded.max_nodes, "the artifact's largest step graph")
    tree = loaded.method_tree(method)
    return tree if tree is not None else TreeSpec.parse(DEFAULT_TREE)


def settings_from(args: argparse.Namespace, loaded: Loaded) -> DecodeSettings:
    rules = StopRules(args.max_new_tokens, loaded.stop_token_ids, tuple(args.stop))
    tree = cli.usage(lambda: choose_tree(args.tree, loaded, args.method))
    if methods.get(args.method).speculative:
        cli.usage(lambda: loaded.check_method_tree(args.method, tree))
    # The calibrated step costs are SS's trees': a draft model's steps cost its calls besides.
    fallback = loaded.fallback(tree) if args.fallback == "auto" and methods.get(args.method).streams else None
    return cli.usage(lambda: DecodeSettings(args.method, rules, tree, SamplingConfig(args.temperature, args.top_k, args.top_p),
                                            prune_config(args.prune_threshold, args.prune_budget), args.seed, fallback,
                                            args.threshold))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_flags(args)
    served = artifact_tasks(args.artifact)
    task = args.task if args.task in served else None  # an artifact with several tasks: the one asked for
    backend = args.backend or fastest_backend(args.artifact, task)
    loaded = load(args.artifact, backend, args.device, args.stream_schedule, args.threads, task=task)
    threads = use_threads(args.threads)
    settings = settings_from(args, loaded)
    as_task = args.task is not None
    if as_task and loaded.info.get("task") != args.task:
        serves = f"serves {', '.join(served)}" if len(served) > 1 else f"was fine-tuned for {loaded.info.get('task')!r}"
        raise cli.UsageError(f"--task {args.task}: {args.artifact} {serves}; use that task name or drop --task")
    if as_task and loaded.prompt is None:
        raise cli.UsageError(f"--task {args.task}: {args.artifact} records no prompt format; rerun export/build.py "
                         f"(it adds it without retraining) or pass plain prompts without --task")
    requests = [Request("0", args.prompt)] if args.prompt is not None else read_requests(args.input_file, loaded, as_task, args.limit)
    trace = Trace(enabled=args.trace is not None, backend=loaded.backend.name, device=args.device, method=settings.method,
                  num_streams=loaded.backend.num_streams, tree=settings.tree.to_dict() if methods.get(settings.method).speculative else None,
                  threads=threads)
    for request in requests:
        over = source_overflow(loaded, request.text, as_task)
        if over:
            fate = ("its end is cut" if args.cut_source else
                    "kept whole (quality past that length is untested; --cut-source cuts it as training did)")
            print(f"warning: input {request.id}: the source is {over} tokens over the {loaded.prompt.max_source_tokens} "
                  f"the model was fine-tuned on; {fate}", file=sys.stderr)
        ids = prompt_ids(loaded, request.text, as_task, cut_source=args.cut_source)
        result = run(loaded, ids, settings, trace, request.id)
        record = {**result_record(request, loaded, result, settings), "source_truncated": bool(over and args.cut_source)}
        print(json.dumps(record) if args.json else f"[{record['id']}] {record['text']}\n  ({record['new_tokens']} tokens, "
              f"{record['model_calls']} calls, CR {record['call_reduction']:.2f}, {record['seconds']:.2f} s)", flush=True)
    if args.trace is not None:
        trace.save(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
