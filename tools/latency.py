"""streamfuse latency: per-call latency of a plain step vs a tree step.

Step latency depends on shapes, not weights, so this builds the base model's architecture with
random weights (a config.json is enough) and times, interleaved: one plain decode step, and one
verify-and-speculate step per tree, at a given context length. Multiply a tree's latency ratio
by the call reduction measured with trained weights to project a speed-up on this device.
With --lossless N it then decodes N random prompts greedily, plainly and with SS on each tree, and reports
whether SS gave plain decoding's tokens on this device and dtype (exit 1 where it did not).

    OMP_WAIT_POLICY=PASSIVE streamfuse latency --gamma 3 --msa-layers 8 \
        --trees "gamma=3,k=1;gamma=3,k=2;[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]" --device cpu --threads 2
"""

from __future__ import annotations

import os
import random
import statistics
import sys
from pathlib import Path

import torch

from streamfuse.export.eager import StreamConfig, TorchBackend
from streamfuse.export.packed_linear import KERNELS
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.accept import accept
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.tools.step_timing import architecture_parser, report_medians, timed


def parse_args(argv):
    parser = architecture_parser(__doc__)
    parser.add_argument("--context", type=int, default=384, help="tokens already in the KV cache")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per configuration (interleaved)")
    parser.add_argument("--stream-schedule", choices=("fused", "deferred"), default="fused")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=KERNELS,
        help="torch linear kernels: packed (oneDNN-prepacked; auto's choice on a CPU) or eager",
    )
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--lossless", type=int, default=0, help="random prompts to decode plainly and with SS")
    parser.add_argument("--lossless-tokens", type=int, default=64, help="new tokens per --lossless run")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def step_calls(backend: TorchBackend, trees: list[TreeSpec]) -> dict:
    """Name -> a zero-argument call doing one step of that kind (scratch rows, never committed): a tree's is the
    greedy step as greedy SS runs it, its streams where --stream-schedule puts them, drafts ranked in the call."""
    calls = {"plain": lambda: backend.step([1], None, with_streams=False).main_logits.argmax(-1)}
    for tree in trees:

        def ss_step(tree=tree):
            tokens = [1] * tree.num_nodes
            out = backend.step(tokens, tree, with_streams=True, greedy=True)
            node = accept(tree, tokens, lambda n: out.next_token(n, int)).path[-1]  # greedy: the engine's choice
            out.stream_top(node, max(tree.widths))  # the accepted node's drafts

        calls[tree_name(tree)] = ss_step
    return calls


def lossless(backend: TorchBackend, trees: list[TreeSpec], runs: int, new_tokens: int) -> dict[str, dict]:
    """Per tree: of `runs` random prompts, how many SS decoded to plain decoding's tokens, and its tokens a step
    (above 1: drafts were accepted, so rows other than the root decided tokens)."""
    rng = random.Random(0)
    rules = StopRules(new_tokens, stop_token_ids=())
    found = {tree_name(tree): {"same": 0, "runs": runs, "tokens_per_step": []} for tree in trees}
    for _ in range(runs):
        prompt = [rng.randrange(1, backend.vocab_size) for _ in range(32)]
        plain = generate(backend, prompt, DecodeSettings(BASELINE_METHOD, rules)).token_ids
        for tree in trees:
            result = generate(backend, prompt, DecodeSettings(DEFAULT_METHOD, rules, tree=tree))
            row = found[tree_name(tree)]
            row["same"] += result.token_ids == plain
            row["tokens_per_step"] += [step.tokens for step in result.run.steps]
    for row in found.values():
        row["tokens_per_step"] = round(statistics.mean(row["tokens_per_step"]), 3)
    return found


def tree_name(tree: TreeSpec) -> str:
    return f"tree {tree.num_nodes} nodes {tree.to_dict()['paths'] if tree.num_nodes <= 8 else tree.hash()}"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    trees = [TreeSpec.parse(text) for text in args.trees.split(";")]
    torch.manual_seed(0)  # the same random weights each run (--lossless decodes with them)
    backend = TorchBackend.with_random_weights(
        args.base_model,
        StreamConfig(args.gamma, args.msa_layers),
        args.device,
        getattr(torch, args.dtype),
        args.stream_schedule,
        args.kernels,
    )
    backend.reset(args.context + max(t.num_nodes for t in trees) + 1)
    backend.prefill(list(range(1, args.context + 1)), with_streams=False)
    calls = step_calls(backend, trees)
    samples = {name: [] for name in calls}
    for rep in range(args.reps + 3):
        for name, call in calls.items():  # interleaved: every configuration sees the same conditions
            seconds = timed(backend, call)
            if rep >= 3:
                samples[name].append(seconds)
    meta = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "context": args.context,
        "gamma": args.gamma,
        "msa_layers": args.msa_layers,
        "stream_schedule": args.stream_schedule,
        "kernels": backend.kernels,
        "load_average": os.getloadavg(),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    }
    if args.lossless:
        meta["lossless"] = lossless(backend, trees, args.lossless, args.lossless_tokens)
    report_medians(samples, "plain", ("config", "ratio_to_plain"), meta, args.out)
    differs = [name for name, row in meta.get("lossless", {}).items() if row["same"] < row["runs"]]
    for name in differs:
        row = meta["lossless"][name]
        print(f"error: SS differs from plain decoding on {row['runs'] - row['same']}/{row['runs']} runs ({name})")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
