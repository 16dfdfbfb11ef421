"""B concurrent requests decoded in shared steps (runtime/request/batch.py) on an artifact's engines: total tokens/s
per B, the time to first token (p50, p95) and whether every output equals its single-request output.

    python -m streamfuse.tools.batch_bench --artifact artifacts/dialogsum --backends executorch,onnxruntime \\
        --batches 1,2,4,8 --threads 2 --prompts 16 --max-new-tokens 64 --out batch_bench.json

Each setting B runs the same prompts as B closed-loop clients: B requests in flight, the next prompt added as soon as
one finishes; a request's time to first token runs from its add to its first emitted token. The settings run
round-robin (--rounds), so every B (and every --batch-policy given) sees the same machine conditions; tokens/s is
each setting's total over its rounds, and x B=1 is against the same policy's B = 1.
The prefill share is the part of that time spent in prefills, which a batch does not share (their rows are bound by
arithmetic already): 1 / (B = 1's share) bounds what any B can gain. Decode tokens/s leaves the prefills out;
"steps held plain" is the share of the steps of 2+ sequences the batch policy (runtime/request/batch_policy.py) ran as
plain rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from streamfuse.runtime.commands import errors
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.batch import BatchDecoder
from streamfuse.runtime.request.batch_policy import POLICIES, POLICY_HELP, PlainRowsPolicy
from streamfuse.runtime.request.frontend import DEFAULT_METHOD, DecodeRequest, decode_settings
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.loader import Loaded, load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.tools.bench_data import read_inputs, task_file


@dataclass
class Setting:
    """One backend's measurements at one B and batch policy, summed over its rounds."""

    backend: str
    batch: int
    policy: str = POLICIES[0]
    tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    shared_steps: int = 0  # of 2+ sequences
    plain_steps: int = 0
    equal: bool = True
    first_token: list[float] = field(default_factory=list)  # seconds, every request of every round

    def add(self, other: Setting) -> None:
        """Another round of the same setting."""
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.prefill_seconds += other.prefill_seconds
        self.steps += other.steps
        self.shared_steps += other.shared_steps
        self.plain_steps += other.plain_steps
        self.equal = self.equal and other.equal
        self.first_token.extend(other.first_token)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the steps alone, the prefills' time left out."""
        decoding = self.seconds - self.prefill_seconds
        return self.tokens / decoding if decoding > 0 else 0.0

    def summary(self, base: Setting) -> dict:
        first = np.array(self.first_token or [0.0])
        return {
            "backend": self.backend,
            "batch_policy": self.policy,
            "batch": self.batch,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "steps": self.steps,
            "plain_share": round(self.plain_steps / self.shared_steps, 3) if self.shared_steps else 0.0,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ratio_to_b1": round(self.tokens_per_second / base.tokens_per_second, 3) if base.seconds else None,
            "prefill_share": round(self.prefill_seconds / self.seconds, 3) if self.seconds else 0.0,
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "decode_ratio_to_b1": (
                round(self.decode_tokens_per_second / base.decode_tokens_per_second, 3)
                if base.decode_tokens_per_second
                else None
            ),
            "ttft_p50_ms": round(1000 * float(np.percentile(first, 50)), 2),
            "ttft_p95_ms": round(1000 * float(np.percentile(first, 95)), 2),
            "all_equal_to_single": self.equal,
        }


def closed_loop(
    loaded: Loaded,
    prompts: list[list[int]],
    settings: DecodeSettings,
    batch: int,
    expected: list[list[int]],
    policy: PlainRowsPolicy | None = None,
) -> Setting:
    """The prompts as `batch` clients send them, each its next once the last one finished. policy: the batch policy
    (None: the method's steps), shared by the runs as a server's lives on."""
    decoder = BatchDecoder(loaded, max_sequences=batch, plain_rows=policy is not None, policy=policy)
    setting = Setting(loaded.engine, batch, POLICIES[0] if policy is not None else POLICIES[1])
    waiting = list(enumerate(prompts))
    lanes, added, first = {}, {}, {}

    def add(index: int, ids: list[int]) -> None:
        def on_step(event, index=index) -> None:
            first.setdefault(index, time.perf_counter())

        added[index] = time.perf_counter()
        lanes[index] = decoder.add(ids, settings, on_step=on_step, run_id=str(index))

    started = time.perf_counter()
    while waiting or decoder.active:
        while waiting and len(decoder.active) < batch:
            add(*waiting.pop(0))
        decoder.step()
    setting.seconds = time.perf_counter() - started
    setting.prefill_seconds = decoder.prefill_seconds
    setting.steps, setting.shared_steps, setting.plain_steps = decoder.steps, decoder.shared_steps, decoder.plain_steps
    for index, lane in lanes.items():
        tokens = lane.result.token_ids
        setting.tokens += len(tokens)
        setting.equal = setting.equal and tokens == expected[index]
        setting.first_token.append(first[index] - added[index])
    return setting


def bench_backend(args: argparse.Namespace, backend: str) -> list[Setting]:
    loaded = load(args.artifact, backend, threads=args.threads)
    if loaded.prompt is None:
        raise errors.UsageError(f"{args.artifact} records no task prompt; rebuild it with streamfuse build")
    path = args.input_file or task_file(loaded.info.get("task"), "validation", args.data_dir)
    prompts = [prompt_ids(loaded, item.text, True) for item in read_inputs(path, loaded.prompt, args.prompts)]
    settings = decode_settings(loaded, DecodeRequest(args.method, args.max_new_tokens, tree=args.tree))
    model = Model(loaded)
    expected = [model.run(ids, settings=settings).token_ids for ids in prompts]  # also the engine's warm-up
    policies = {name: PlainRowsPolicy() if name == POLICIES[0] else None for name in args.batch_policy}
    runs = [(batch, name) for batch in args.batches for name in policies]
    for batch, name in runs:  # each batched graph's first calls (and the policy's first measurements), untimed
        closed_loop(loaded, prompts[:batch], settings, batch, expected, policies[name])
    totals = {(batch, name): Setting(backend, batch, name) for batch, name in runs}
    for _ in range(args.rounds):
        for batch, name in runs:
            totals[batch, name].add(closed_loop(loaded, prompts, settings, batch, expected, policies[name]))
    return list(totals.values())


def table(rows: list[dict]) -> str:
    lines = [
        "| backend | batch policy | B | tokens/s | x B=1 | prefill share | decode tokens/s | x B=1 | steps held plain "
        "| TTFT p50 (ms) | TTFT p95 (ms) | all equal to single |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ratio = f"{row['ratio_to_b1']:.2f}" if row["ratio_to_b1"] is not None else "-"
        decode = f"{row['decode_ratio_to_b1']:.2f}" if row["decode_ratio_to_b1"] is not None else "-"
        lines.append(
            f"| {row['backend']} | {row['batch_policy']} | {row['batch']} | {row['tokens_per_second']:.1f} | {ratio} | "
            f"{row['prefill_share']:.2f} | {row['decode_tokens_per_second']:.1f} | {decode} | "
            f"{row['plain_share']:.2f} | "
            f"{row['ttft_p50_ms']:.1f} | {row['ttft_p95_ms']:.1f} | {'yes' if row['all_equal_to_single'] else 'no'} |"
        )
    return "\n".join(lines)


def integers(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers separated by commas, e.g. 1,2,4,8")
    return values


def policies(text: str) -> list[str]:
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names or any(name not in POLICIES for name in names):
        raise argparse.ArgumentTypeError(f"{text!r}: give batch policies of {', '.join(POLICIES)}, comma-separated")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="an exported artifact folder")
    parser.add_argument("--backends", default="executorch,onnxruntime", help="engines to measure, comma-separated")
    parser.add_argument(
        "--batches", type=integers, default=[1, 2, 4, 8], help="concurrent requests B (default 1,2,4,8)"
    )
    parser.add_argument("--threads", type=int, default=2, help="the engines' threads (default 2)")
    parser.add_argument("--prompts", type=int, default=16, help="requests per setting, from the task's data")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--method", default=DEFAULT_METHOD, help=f"decoding method (default {DEFAULT_METHOD})")
    parser.add_argument("--tree", default=None, help="the draft tree (default: the method's own, e.g. calibrated)")
    parser.add_argument(
        "--batch-policy",
        type=policies,
        default=[POLICIES[0]],
        help=f"{POLICY_HELP}; several, comma-separated, interleave",
    )
    parser.add_argument("--rounds", type=int, default=1, help="round-robin passes over the B settings")
    parser.add_argument("--input-file", type=Path, default=None, help="JSON lines of task inputs (default: validation)")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the task's data files are")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    if min(args.threads, args.prompts, args.max_new_tokens, args.rounds) < 1:
        parser.error("--threads, --prompts, --max-new-tokens and --rounds must be >= 1")
    if not args.backends:
        parser.error("--backends: name at least one engine, e.g. executorch,onnxruntime")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for backend in args.backends:
        settings = bench_backend(args, backend)
        for setting in settings:
            same = [s for s in settings if s.policy == setting.policy]
            rows.append(setting.summary(next((s for s in same if s.batch == 1), same[0])))
    print(table(rows))
    if args.out:
        record = {
            "artifact": str(args.artifact),
            "method": args.method,
            "batch_policies": args.batch_policy,
            "threads": args.threads,
            "rows": rows,
        }
        record["command"] = " ".join(["streamfuse", "batch-bench", *(argv if argv is not None else sys.argv[1:])])
        args.out.write_text(json.dumps(record, indent=2))
    return 0 if all(row["all_equal_to_single"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(errors.run(main, prog="batch-bench"))
