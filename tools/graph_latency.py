"""streamfuse graph-latency: per-call latency of the exported graphs on ONNX Runtime.

Call latency depends on shapes, not weights, so this builds the base model's architecture with
random weights, exports `decode` and, per tree (in a bucket of its size), `step`, `streams` and greedy_step in every
requested variant (stream schedule x draft vocabulary size) to ONNX in a scratch folder, and
times them interleaved at a given cache length. It measures what export/graph.py's "auto"
schedule and the default draft vocabulary size rest on; rerun it on the target device.

    OMP_WAIT_POLICY=PASSIVE streamfuse graph-latency --threads 2 \
        --trees "gamma=3,k=1;[[0],[1],[0,0],[0,1],[1,0],[0,0,0]];gamma=3,k=2" --draft-vocab 16384,0
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from streamfuse.export.eager import StreamConfig, TorchBackend
from streamfuse.export.graph import GraphShapes, example_inputs
from streamfuse.export.passes import GreedyStepPass, MainPass, StepPass, StreamsPass
from streamfuse.runtime.artifact.contract import INPUT_NAMES, OUTPUT_NAMES, STREAM_SCHEDULES, tree_inputs
from streamfuse.runtime.backends.runners import OnnxRuntimeRunner
from streamfuse.runtime.backends.static_graph import interleaved_call_times
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.tools.step_timing import architecture_parser, report_medians

PREFILL_CHUNK = 8  # prefill is not timed; the shapes only need a valid chunk


def parse_args(argv):
    parser = architecture_parser(__doc__)
    parser.add_argument("--schedules", default="fused,deferred", help="greedy_step stream schedules to time")
    parser.add_argument("--draft-vocab", default="16384,0", help="draft vocabulary sizes to time (0: all tokens)")
    parser.add_argument("--capacity", type=int, default=768, help="KV capacity of the graphs")
    parser.add_argument("--context", type=int, default=450, help="cache rows in use (cache_len)")
    parser.add_argument("--reps", type=int, default=25, help="timed calls per graph (interleaved)")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args(argv)


def graph_variants(model, args) -> dict[str, tuple[torch.nn.Module, tuple]]:
    """label -> (module, example inputs) for every graph to time: each tree in a bucket of its own size."""
    trees = [TreeSpec.parse(text) for text in args.trees.split(";")]
    variants = {
        "decode": (MainPass(model, 1), example_inputs(model, GraphShapes(args.capacity, PREFILL_CHUNK, (2,)))["decode"])
    }
    vocab = model.parts.vocab_size
    for tree in trees:
        rows = tree.num_nodes
        shapes = GraphShapes(args.capacity, PREFILL_CHUNK, (rows,))
        inputs = example_inputs(model, shapes)
        visible, depths, parents = map(torch.from_numpy, tree_inputs(tree, rows))
        name = f"{rows} nodes"
        ids, length, *_, keys, values = inputs["step_" + str(rows)]
        variants[f"step, {name}"] = (StepPass(model), (ids, length, visible, depths, keys, values))
        variants[f"streams (after step, {name})"] = (StreamsPass(model), inputs["streams"])
        for schedule in args.schedules.split(","):
            for size in (int(s) for s in args.draft_vocab.split(",")):
                draft_ids = range(size) if 0 < size < vocab else None
                label = f"greedy_step, {name}, {schedule}, draft vocab {size or vocab}"
                variants[label] = (
                    GreedyStepPass(model, rows, shapes.width, draft_ids, schedule),
                    (ids, length, visible, depths, parents, keys, values),
                )
    return variants


def feed(method: str, inputs: tuple, context: int, vocab: int) -> list[np.ndarray]:
    """The example inputs with a cache in use up to `context` rows and token ids drawn at random."""
    named = dict(zip(INPUT_NAMES[method], (t.clone() for t in inputs)))
    named["cache_len"] = torch.tensor([context])
    if "anchor" in named:
        named["anchor"] = torch.randn_like(named["anchor"])
    else:
        named["ids"] = torch.randint(0, vocab, named["ids"].shape)
    for name in ("keys", "values"):
        named[name] = torch.randn_like(named[name]) * 0.1
    return [tensor.numpy() for tensor in named.values()]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if set(args.schedules.split(",")) - set(STREAM_SCHEDULES):
        raise SystemExit(f"--schedules takes {', '.join(STREAM_SCHEDULES)}, got {args.schedules}")
    # eager kernels: this model is exported, and oneDNN-packed weights do not export.
    model = TorchBackend.with_random_weights(
        args.base_model, StreamConfig(args.gamma, args.msa_layers), kernels="eager"
    ).model
    from streamfuse.export.to_onnx import export_onnx

    variants = graph_variants(model, args)
    with tempfile.TemporaryDirectory(prefix="graph-latency-") as scratch:
        runners, feeds = {}, {}
        for index, (label, (module, inputs)) in enumerate(tqdm(variants.items(), desc="export", unit="graph")):
            method = label.split(",")[0].split(" ")[0]
            folder = Path(scratch) / str(index)
            folder.mkdir()
            onnx_file, _ = export_onnx({method: module}, {method: inputs}, INPUT_NAMES, OUTPUT_NAMES, folder)
            runners[label] = (OnnxRuntimeRunner(folder / onnx_file, threads=args.threads), method)
            feeds[label] = feed(method, inputs, args.context, model.parts.vocab_size)
        calls = {label: (runner, method, feeds[label]) for label, (runner, method) in runners.items()}
        samples = interleaved_call_times(calls, args.reps, 3, lambda rounds: tqdm(rounds, desc="time", unit="round"))
    meta = {
        "engine": "onnxruntime:CPUExecutionProvider",
        "threads": args.threads,
        "capacity": args.capacity,
        "context": args.context,
        "gamma": args.gamma,
        "msa_layers": args.msa_layers,
        "load_average": os.getloadavg(),
    }
    report_medians(samples, "decode", ("graph", "ratio_to_decode"), meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
