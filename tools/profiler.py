"""Call-reduction profiler for decode traces ("streamfuse.trace/3") of any backend and method.

    streamfuse profile TRACE.json [--baseline AR_TRACE.json] --out DIR

Writes DIR/profile.json, DIR/profile.md and three PNG plots. Pure Python + matplotlib (Agg):
no torch, so a trace recorded on any accelerator can be profiled on any machine.
Every metric is defined in LEGEND (runtime/measure/trace_profile.py), which profile.md repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamfuse.runtime.commands import errors
from streamfuse.runtime.measure.trace_profile import fmt, profile_files, write_report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Profile a streamfuse.trace/3 decode trace: call reduction, acceptance per depth "
        "(= per stream), tree utilisation, pruning, time split, memory."
    )
    parser.add_argument("trace", type=Path, help="decode trace JSON (schema streamfuse.trace/3) to profile")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="trace of plain (ar) decoding on the same prompts: adds measured call ratio and "
        "wall-clock speed-up over the run ids present in both traces",
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for profile.json, profile.md and the PNG plots (created if missing)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        metrics = profile_files(args.trace, args.baseline)
    except (OSError, ValueError) as exc:  # the traces named on the command line: exit 2
        raise errors.UsageError(str(exc)) from exc
    for path in write_report(metrics, args.out):
        print(path)
    print(
        f"CR {fmt(metrics['call_reduction'])}, {fmt(metrics['tokens_per_s'])} tokens/s, "
        f"{fmt(metrics['mean_tokens_per_step'])} tokens per verify call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
