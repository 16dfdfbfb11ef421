"""streamfuse draft-latency: a draft model's call (methods sd, specdec++) by LM head size, per engine.

A draft call runs the base's first --layers decoder layers and the LM head; SmolLM2's tied head (49,152 x 576)
weighs twice a 4-layer stack. This builds that model with random weights (a call's cost depends on shapes, not
weights), keeps each --head-vocab size of its head (SpeculativeStreamingLM.keep_vocab; 0: all tokens), exports
prefill and decode as the build does for each engine (ONNX Runtime: rows in place; ExecuTorch/XNNPACK: the span
kernel) and times one decode call through the host, as the drafter makes it (logits spread over the vocabulary
included), every engine and size interleaved, at --context cache rows.

    OMP_WAIT_POLICY=PASSIVE streamfuse draft-latency --threads 2 --head-vocab 0,16384,8192,4096
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from streamfuse import seams
from streamfuse.adapters.base_model import resolve_base_model
from streamfuse.adapters.hf import keep_first_layers
from streamfuse.adapters.model import SpeculativeStreamingLM
from streamfuse.export import graph
from streamfuse.export.eager import TorchBackend
from streamfuse.methods.sd.model import NOMINAL_STREAMS
from streamfuse.runtime.backends.runners import open_runner
from streamfuse.runtime.backends.static_graph import StaticGraphBackend
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.tools.step_timing import step_seconds

ENGINES = ("torch", "executorch", "onnxruntime")
PREFILL_CHUNK = 64
METHODS = ("prefill", "decode")  # what a draft model's calls use


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="smollm2-135m-instruct", help="model name or a folder with config.json")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the draft model (sd.layers)")
    parser.add_argument("--head-vocab", default="0,16384,8192,4096", help="LM head sizes to time (0: all tokens)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"any of {', '.join(ENGINES)}")
    parser.add_argument("--capacity", type=int, default=772, help="KV capacity of the graphs (the build's: 768 + 4)")
    parser.add_argument("--context", type=int, default=450, help="cache rows in use")
    parser.add_argument("--reps", type=int, default=40, help="timed calls per configuration (interleaved)")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    if set(engines) - set(ENGINES):
        parser.error(f"--engines takes {', '.join(ENGINES)}, got {args.engines}")
    try:
        args.sizes = [int(size) for size in args.head_vocab.split(",")]
    except ValueError:
        parser.error(f"--head-vocab takes comma-separated whole numbers, got {args.head_vocab!r}")
    if args.context + 1 > args.capacity:
        parser.error(f"--context {args.context} leaves no slot in --capacity {args.capacity}")
    args.engines = engines
    return args


def draft_model(base_model: str, layers: int, size: int) -> SpeculativeStreamingLM:
    """The base's first `layers` layers with random weights (methods/sd/model.py's shape), its head keeping
    the `size` lowest ids (0: all): which ids does not change a call's cost."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_base_model(base_model))
    seams.set_attention_implementation(config, "sdpa")
    model = SpeculativeStreamingLM(keep_first_layers(AutoModelForCausalLM.from_config(config), layers), NOMINAL_STREAMS)
    if 0 < size < model.parts.vocab_size:
        model.keep_vocab(torch.arange(size))
    return model.eval().requires_grad_(False)


def exported(model, engine: str, capacity: int, folder: Path, threads: int) -> StaticGraphBackend:
    """prefill and decode of `model` on `engine`, laid out as the build lays them out there."""
    from streamfuse.export.xnnpack_graph import engine_model

    ready = engine_model(model, engine)
    shapes = graph.GraphShapes(capacity, PREFILL_CHUNK, (2,), span=True)
    modules = {name: module for name, module in graph.graph_modules(ready, shapes).items() if name in METHODS}
    inputs = {name: value for name, value in graph.example_inputs(ready, shapes).items() if name in METHODS}
    folder.mkdir(parents=True)
    if engine == "executorch":
        from streamfuse.export.to_executorch import export_pte

        export_pte(modules, inputs, folder / "model.pte")
        files = {"program": folder / "model.pte"}
    else:
        from streamfuse.export.to_onnx import export_onnx

        names = graph.names_of(modules, shapes)
        onnx_file, _ = export_onnx(modules, inputs, *names, folder)
        files = {"model": folder / onnx_file}
    return StaticGraphBackend(open_runner(engine, files, threads), graph.graph_spec(model, shapes, ["deferred"]))


def report(samples: dict[tuple[str, int], list[float]], meta: dict, out: Path | None) -> None:
    """Median ms per engine and head size, and its ratio to the same engine's largest head."""
    rows = []
    for (engine, vocab), times in samples.items():
        whole = max(v for e, v in samples if e == engine)
        rows.append(
            {
                "engine": engine,
                "head_vocab": vocab,
                "median_ms": 1000 * statistics.median(times),
                "ratio_to_full_head": statistics.median(times) / statistics.median(samples[engine, whole]),
            }
        )
    print(json.dumps(meta))
    for row in rows:
        print(
            f"{row['engine']:<12} head {row['head_vocab']:>6}  {row['median_ms']:7.2f} ms  "
            f"x{row['ratio_to_full_head']:.2f}"
        )
    if out:
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    backends, rng = {}, np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="draft-latency-") as scratch:
        for size in tqdm(args.sizes, desc="export", unit="head"):
            model = draft_model(args.base_model, args.layers, size)
            vocab = size if 0 < size < model.parts.vocab_size else model.parts.vocab_size
            for engine in args.engines:
                folder = Path(scratch) / f"{engine}-{vocab}"
                # torch packs the linear layers of what it is given in place: a copy, so the exports see float ones
                backends[engine, vocab] = (
                    TorchBackend(copy.deepcopy(model))
                    if engine == "torch"
                    else exported(model, engine, args.capacity, folder, args.threads)
                )
        for backend in backends.values():
            backend.reset(args.capacity)
            backend.prefill(rng.integers(0, backend.vocab_size, args.context).tolist(), with_streams=False)
        samples: dict[tuple[str, int], list[float]] = {label: [] for label in backends}
        for round_ in tqdm(range(args.reps + 3), desc="time", unit="round"):
            for label, backend in backends.items():
                elapsed = step_seconds(backend, [int(rng.integers(0, backend.vocab_size))], None)
                if round_ >= 3:
                    samples[label].append(elapsed)
    meta = {
        "threads": args.threads,
        "layers": args.layers,
        "capacity": args.capacity,
        "context": args.context,
        "load_average": os.getloadavg(),
    }
    report(samples, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
