"""streamfuse call-times: what each of an artifact's methods costs per call on one engine,
by the cache slots in use: the figures behind a tree step's cost in plain calls.

    OMP_WAIT_POLICY=PASSIVE streamfuse call-times --artifact artifacts/dialogsum \\
        --backend executorch --spans 64,300,700 --rounds 40 --threads 2

Inputs come from the manifest's method signatures: random token ids and caches (a call's time depends on
shapes, not values), in each step bucket the first of the artifact's trees that fits it (else a tree
filling it), `cache_len` set to each span, and a commit that moves nothing. Calls are interleaved across
methods; medians are printed (and written as JSON with --out). The row `greedy_step_T, commit M` is the largest
greedy step again, now also moving M accepted rows of the previous step into place in the engine's cache (every
node but the second of a T-node step: M = T - 1, T - 2 of them moved): what committing adds to a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from streamfuse.runtime.artifact.contract import COMMIT_INPUT, base_method, bucket_method
from streamfuse.runtime.artifact.format import Artifact
from streamfuse.runtime.backends.runners import open_runner
from streamfuse.runtime.backends.static_graph import interleaved_call_times
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.commands import errors
from streamfuse.tools.graph_inputs import method_inputs

ENGINES = ("executorch", "onnxruntime")
SKIPPED = ("prefill",)  # its time is per prompt chunk, not per decoded token: the calibration reports it


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True, help="exported artifact (streamfuse build)")
    parser.add_argument("--backend", choices=ENGINES, required=True, help="the engine to time")
    parser.add_argument("--spans", default="64,300,700", help="cache slots in use, comma-separated")
    parser.add_argument("--rounds", type=int, default=40, help="timed calls per method and span")
    parser.add_argument("--threads", type=threads_type, default=2, help="CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="write the medians as JSON here")
    errors.add_debug_flag(parser)
    return parser.parse_args(argv)


def with_commit(signature: dict, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """`inputs` whose commit accepts every node of the previous step but its second -> (inputs, rows accepted)."""
    names = [i["name"] for i in signature["inputs"]]
    commit = inputs[names.index(COMMIT_INPUT)].copy()
    accepted = [0, *range(2, len(commit))]
    commit[: len(accepted)] = accepted
    changed = list(inputs)
    changed[names.index(COMMIT_INPUT)] = commit
    return changed, len(accepted)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    words = [s.strip() for s in args.spans.split(",") if s.strip()]
    errors.check(
        bool(words) and all(w.isdigit() for w in words),
        f"--spans takes slot counts such as 64,300,700, got {args.spans!r}",
    )
    spans = [int(w) for w in words]
    errors.check(args.rounds >= 1 and args.threads >= 1, "--rounds and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    artifact = Artifact.open(args.artifact)
    graphs = artifact.manifest["graphs"]
    capacity, gamma = graphs["capacity"], artifact.manifest["streams"]["num_streams"]
    vocab = artifact.manifest["model"]["vocab_size"]
    largest = max(graphs["buckets"])
    most = capacity - largest  # a step's rows go after the span
    errors.check(
        all(largest <= s <= most for s in spans),
        f"--spans must lie in [{largest}, {most}] (the artifact's "
        f"cache holds {capacity} slots, a step adds up to {largest} and commits up to {largest - 1}), "
        f"got {args.spans}",
    )
    session = open_runner(args.backend, artifact.backend_files(args.backend), args.threads)
    methods = {name: sig for name, sig in graphs["methods"].items() if base_method(name) not in SKIPPED}
    greedy = bucket_method("greedy_step", largest)
    table, commit = {}, None
    for span in spans:
        calls = {
            name: (session, name, method_inputs(sig, span, artifact.trees, gamma, vocab))
            for name, sig in methods.items()
        }
        inputs, moved = with_commit(methods[greedy], calls[greedy][2])
        commit = f"{greedy}, commit {moved}"
        calls[commit] = (session, greedy, inputs)
        samples = interleaved_call_times(calls, args.rounds, 1)
        table[span] = {name: 1000 * statistics.median(times) for name, times in samples.items()}
    print(
        f"{args.backend}, {args.threads} threads, median of {args.rounds} interleaved calls (ms); step buckets "
        f"carry the artifact's first tree that fits"
    )
    print(f"{'method':<20}" + "".join(f"{span:>10}" for span in spans))
    for name in [*methods, commit]:
        print(f"{name:<20}" + "".join(f"{table[span][name]:>10.3f}" for span in spans))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "backend": args.backend,
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "ms": {str(span): row for span, row in table.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
