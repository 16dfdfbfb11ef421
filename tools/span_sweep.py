"""streamfuse span-sweep: step time of the exported graphs by engine, used span and rows.

Call latency depends on shapes, not weights, so this builds the base model's architecture with random
weights, exports `decode` and a step graph per --rows bucket to one program per --engine and --capacity
(the cache the graphs are built for), and times every (engine, capacity, rows, span) interleaved. On
both engines attention is the exact kernel over the used span (export/span_attention.py), reading the
host's cache in place: a call's time grows with the span, not with the capacity.

    OMP_WAIT_POLICY=PASSIVE streamfuse span-sweep --threads 2 --engine executorch,onnxruntime \
        --rows 1,4,8 --spans 64,256,512,740 --capacity 768,1024 --out bench/span-sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from streamfuse.export.eager import StreamConfig, TorchBackend
from streamfuse.export.graph import GraphShapes, example_inputs, graph_modules, names_of
from streamfuse.export.to_executorch import export_pte
from streamfuse.export.to_onnx import export_onnx
from streamfuse.export.xnnpack_graph import engine_model
from streamfuse.runtime.artifact.contract import bucket_method, tree_inputs
from streamfuse.runtime.backends.runners import ExecuTorchRunner, OnnxRuntimeRunner
from streamfuse.runtime.backends.static_graph import GraphRunner, interleaved_call_times
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.speculation.tree import TreeSpec

PREFILL_CHUNK = 8  # prefill is not timed; the shapes only need a valid chunk


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="smollm2-135m-instruct", help="model name or a folder with config.json")
    parser.add_argument("--engine", default="executorch", help="engines, comma-separated: executorch, onnxruntime")
    parser.add_argument("--gamma", type=int, default=3, help="number of streams")
    parser.add_argument("--msa-layers", type=int, default=8, help="N_s")
    parser.add_argument("--rows", default="1,4,8,16", help="row counts: 1 is decode, others step graphs of that size")
    parser.add_argument("--spans", default="64,256,512,740", help="cache slots in use (cache_len)")
    parser.add_argument("--capacity", default="768", help="cache capacities to build programs for")
    parser.add_argument("--reps", type=int, default=15, help="timed calls per configuration (interleaved)")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


ENGINES = ("executorch", "onnxruntime")


def step_buckets(rows: list[int]) -> tuple[int, ...]:
    return tuple(r for r in rows if r > 1) or (2,)


def program(engine: str, model, capacity: int, rows: list[int], folder: Path, threads: int) -> GraphRunner:
    """decode and the step graphs of `rows` (> 1) in one program of `engine` for a cache of `capacity` slots."""
    buckets = step_buckets(rows)
    shapes = GraphShapes(capacity, PREFILL_CHUNK, buckets, span=True)
    modules = {
        name: module
        for name, module in graph_modules(model, shapes).items()
        if name == "decode" or name.startswith("step_")
    }
    examples = example_inputs(model, shapes)
    inputs = {name: examples[name] for name in modules}
    if engine == "executorch":
        path = folder / f"sweep-{capacity}.pte"
        export_pte(modules, inputs, path)
        return ExecuTorchRunner(path, threads)
    target = folder / f"onnx-{capacity}"
    target.mkdir()
    export_onnx(modules, inputs, *names_of(modules, shapes), target)
    return OnnxRuntimeRunner(target / "model.onnx", threads=threads)


def call_inputs(rows: int, span: int, capacity: int, model, buckets: list[int]) -> tuple[str, list[np.ndarray]]:
    """The method and inputs of a call of `rows` rows (a chain) after `span` cached slots (and no commit)."""
    parts = model.parts
    shape = (parts.num_layers, parts.num_kv_heads, capacity, parts.head_dim)
    generator = np.random.default_rng(span)
    keys, values = (generator.standard_normal(shape, dtype=np.float32) * 0.1 for _ in range(2))
    ids, length = generator.integers(0, parts.vocab_size, (1, rows)), np.array([span])
    commit = np.full(max(buckets), -1, dtype=np.int64)
    if rows == 1:
        return "decode", [ids, length, keys, values, commit]
    tree, depths, _ = tree_inputs(TreeSpec.chain(rows - 1), rows)
    return bucket_method("step", rows), [ids, length, tree, depths, keys, values, commit]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, spans, capacities = numbers(args.rows), numbers(args.spans), numbers(args.capacity)
    engines = [engine.strip() for engine in args.engine.split(",")]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise SystemExit(f"span_sweep: error: --engine {','.join(unknown)}: choose from {', '.join(ENGINES)}")
    base = (
        TorchBackend.with_random_weights(args.base_model, StreamConfig(args.gamma, args.msa_layers), kernels="eager")
        .model.eval()
        .requires_grad_(False)
    )
    calls = {}
    with tempfile.TemporaryDirectory(prefix="span-sweep-") as scratch:
        for engine, capacity in tqdm([(e, c) for e in engines for c in capacities], desc="lower", unit="program"):
            model = engine_model(base, engine)
            runner = program(engine, model, capacity, rows, Path(scratch), args.threads)
            for count in rows:
                for span in spans:
                    if span + count <= capacity:
                        calls[engine, capacity, count, span] = (
                            runner,
                            *call_inputs(count, span, capacity, model, step_buckets(rows)),
                        )
        samples = interleaved_call_times(calls, args.reps, 2, lambda rounds: tqdm(rounds, desc="time", unit="round"))
    table = [
        {"engine": e, "capacity": c, "rows": r, "span": s, "ms": round(1e3 * statistics.median(v), 3)}
        for (e, c, r, s), v in samples.items()
    ]
    meta = {"threads": args.threads, "reps": args.reps, "load_average": os.getloadavg(), "rows": table}
    print("engine      capacity  rows  span     ms")
    for row in table:
        print(f"{row['engine']:10s}  {row['capacity']:8d}  {row['rows']:4d}  {row['span']:4d}  {row['ms']:7.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
