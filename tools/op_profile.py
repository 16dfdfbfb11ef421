"""streamfuse op-profile: where every millisecond of a prefill chunk, a decode call, a 4-row step and a greedy step
goes, op by op, on ONNX Runtime (its profiler) and ExecuTorch (ETDump), grouped into named buckets.

    OMP_WAIT_POLICY=PASSIVE streamfuse op-profile --artifact A --backends onnxruntime,executorch \\
        --spans 300 --rounds 20 --threads 2 [--json OUT]

Each graph (prefill of one chunk, decode, step_T without streams, greedy_step_T with them, and streams) runs on
random inputs of the manifest's shapes with `cache_len` = the span (tools/graph_inputs.py) in a session with the
engine's profiler on, each call just after the same call in a plain session: its wall time. Per graph the table
gives each bucket's median over the profiled calls (ms), their sum (the profiled total), the wall time, and the
remainder (dispatch: what no op event covers), then greedy_step - decode by bucket: what the stream rows and the
extra tree rows cost.

Buckets: RULES (op type / node name pattern -> kind, first match wins), then the op's place in the graph, counted
in norms (two per layer, the final one after): linears in the layers below the stream layers are "main layers",
in the top msa_layers "stream layers"; between the two, the stream inputs (f_eta and what builds the stream rows);
after the last layer, the LM head (the vocabulary-wide linear) and the draft head (the draft vocabulary's).
ExecuTorch's events carry names only (no shapes): a linear is "main layers" or "stream layers" by its place, and a
head by order (the LM head first). Limits: the 4-bit op's LoRA runs inside the op (ORT's Q4Linear, ExecuTorch's
q4_linear), so its time is the linears'; LoRA is a bucket of its own only where it is separate nodes. Ops inside an
XNNPACK delegate are timed only where the runtime records delegate events; otherwise the delegate call is one event
(classified as a linear: the linears are what the build delegates).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamfuse.runtime.artifact.contract import bucket_method
from streamfuse.runtime.artifact.format import Artifact
from streamfuse.runtime.backends.runners import open_runner
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.commands import errors
from streamfuse.tools.graph_inputs import method_inputs
from streamfuse.tools.op_sampling import NO_ETDUMP, perf_runs

ENGINES = ("onnxruntime", "executorch")

# (field, pattern, kind): the first rule whose pattern (re.search, any case) is found in the event's op type ("op")
# or node name ("name") gives its kind; kinds in PLACED are then refined by the op's place (buckets_of).
RULES: tuple[tuple[str, str, str], ...] = (
    ("op", r"^If$", "method switch"),  # the ONNX model's top level: an If per method (the taken one is its nodes)
    ("name", r"^Equal_\d+$", "method switch"),
    ("op", r"tree_attention|TreeAttention", "attention kernel"),
    ("op", r"commit_rows|CommitRows", "cache commit"),
    ("name", r"lora|/left$|/right$|/sum$", "LoRA (separate nodes)"),
    ("op", r"topk|ArgMax|argmax", "top-k / accept"),
    (
        "op",
        r"q4_linear|q8_tiles|Q4Linear|Q8Linear|MatMulNBits|MatMul|Gemm|linear|addmm|^mm$|bmm|DELEGATE_CALL",
        "linear",
    ),
    ("op", r"LayerNorm|rms_norm|rsqrt|Normalization", "norms"),
    ("op", r"RotaryEmbedding|^(Sin|Cos)$|sin\.|cos\.", "RoPE"),
    ("name", r"rotary|/half$|node_(sin|cos)|inv_freq", "RoPE"),
    ("op", r"Sigmoid|silu|Gelu|Tanh", "SwiGLU / activations"),
    ("op", r"^(Greater|Less|Not|Where|Equal|Cast)$|_to_copy|gt\.|lt\.|where|logical|eq\.", "masks (tree, streams)"),
    ("name", r"repeat_interleave|node_select", "masks (tree, streams)"),
    ("name", r"embedding", "embedding"),
    ("op", r"Concat|cat|Slice|Split|Reshape|view|Transpose|permute|copy|Expand|Unsqueeze|Squeeze|Gather", "copies"),
)
PLACED = ("linear", "copies", "other")
HEAD_WIDTH = 32  # a linear after the last layer narrower than this (any vocabulary is wider) is the accept rule's
BUCKETS = (  # the table's rows, in this order
    "linears: main layers",
    "linears: stream layers",
    "LoRA (separate nodes)",
    "attention kernel",
    "cache commit",
    "norms",
    "SwiGLU / activations",
    "RoPE",
    "f_eta / stream inputs",
    "masks (tree, streams)",
    "top-k / accept",
    "draft head",
    "LM head",
    "embedding",
    "copies / concats / other",
    "method switch",
    # ExecuTorch sampled by symbol (no ETDump): SYMBOLS' buckets beside the shared ones
    "linears: streamfuse op (all)",
    "linears: XNNPACK (all)",
    "elementwise (SwiGLU..)",
    "threadpool wait, system",
    "runtime dispatch (ET, Python)",
    "other (unresolved symbols)",
)


@dataclass(frozen=True)
class OpTime:
    """One op event of one call: its node name, op type, microseconds, and its output's last dim where the engine
    says (ONNX Runtime)."""

    name: str
    op: str
    us: float
    width: int | None = None


@dataclass(frozen=True)
class Shape:
    """What places an op: the model's layers, how many on top run the streams, and which graph it is."""

    layers: int
    msa_layers: int
    graph: str  # decode, step_T, greedy_step_T, streams: greedy_step and streams carry stream rows

    @property
    def streams(self) -> bool:
        return self.graph == "streams" or self.graph.startswith("greedy_step")


def kind_of(op: str, name: str) -> str:
    for field, pattern, kind in RULES:
        if re.search(pattern, op if field == "op" else name, re.IGNORECASE):
            return kind
    return "other"


def buckets_of(ops: Sequence[OpTime], shape: Shape) -> list[str]:
    """Each op's bucket, in call order: its kind (RULES); a linear, copy or other op then by its place, counted in
    norms (two per layer, input and post-attention, then the final one; the streams graph starts at the first
    stream layer): a linear below the stream layers is "main layers", in them "stream layers", after the last
    "LM head" (the first; the streams graph's and later ones are "draft head"); between the last main layer's
    MLP and the first stream layer's norm, in a graph with stream rows, everything but masks is "stream inputs"
    (f_eta, the anchors' gather, the identifiers); an elementwise op in an MLP half is the SwiGLU's."""
    if ops and ops[0].op.startswith("perf:"):  # already bucketed by symbol (ExecuTorch without ETDump)
        return [o.op.removeprefix("perf:") for o in ops]
    kinds = [kind_of(o.op, o.name) for o in ops]
    first_stream = shape.layers - shape.msa_layers
    offset = 2 * first_stream if shape.graph == "streams" else 0  # the streams graph's first norm is that layer's
    norms, seen = [], offset
    for kind in kinds:
        seen += kind == "norms"
        norms.append(seen)
    gap = 2 * first_stream  # norms seen between the last main layer's MLP and the first stream layer
    # the last main layer's MLP ends with as many linears as the first layer's MLP has (gate/up packed or not, down);
    # the gap's later linears are f_eta's. The streams graph starts in the gap: it has no MLP there.
    mlp = sum(k == "linear" and n == 2 for k, n in zip(kinds, norms))
    in_last = [i for i, (k, n) in enumerate(zip(kinds, norms)) if k == "linear" and n == gap]
    mlp_end = in_last[mlp - 1] if shape.graph != "streams" and 0 < mlp <= len(in_last) else -1
    heads = 0
    out = []
    for index, (op, kind, seen) in enumerate(zip(ops, kinds, norms)):
        layer = (seen - 1) // 2  # -1: before the first norm; shape.layers: after the last layer
        in_gap = shape.streams and shape.msa_layers > 0 and seen == gap and index > mlp_end
        if kind not in PLACED:
            out.append(kind)
        elif in_gap:
            out.append("f_eta / stream inputs")
        elif kind == "linear" and layer >= shape.layers and op.width is not None and op.width < HEAD_WIDTH:
            out.append("top-k / accept")  # the greedy rule's products over the tree's rows
        elif kind == "linear" and layer >= shape.layers:
            out.append("LM head" if heads == 0 and shape.graph != "streams" else "draft head")
            heads += 1
        elif kind == "linear":
            out.append("linears: stream layers" if layer >= first_stream else "linears: main layers")
        elif layer >= shape.layers:
            out.append("top-k / accept" if kind == "other" else "copies / concats / other")
        elif kind == "other" and seen > 0 and seen % 2 == 0:
            out.append("SwiGLU / activations")  # the gate's product (and the residual adds, where not in a norm)
        else:
            out.append("copies / concats / other")
    return out


def bucket_table(runs: Sequence[Sequence[OpTime]], shape: Shape) -> dict[str, float]:
    """Per bucket, the median over calls of its summed ms (runs: each call's op events, in call order; perf samples:
    its share of them all times the median call); with the total, their sum, under "profiled"."""
    sums: dict[str, list[float]] = {name: [] for name in BUCKETS}
    for run in runs:
        totals = dict.fromkeys(BUCKETS, 0.0)
        for op, name in zip(run, buckets_of(run, shape)):
            totals[name] += op.us / 1000
        for name in BUCKETS:
            sums[name].append(totals[name])
    table = {name: statistics.median(values) if values else 0.0 for name, values in sums.items()}
    if any(op.op.startswith("perf:") for run in runs for op in run):
        # perf's samples are few per call: each bucket's share of all the calls' samples, times the median call
        pooled, calls = {name: sum(v) for name, v in sums.items()}, [sum(run_ms) for run_ms in zip(*sums.values())]
        total = sum(pooled.values()) or 1.0  # no sample at all: every bucket 0
        table = {name: ms / total * statistics.median(calls) for name, ms in pooled.items()}
    return {**table, "profiled": sum(table.values())}


def top_ops(runs: Sequence[Sequence[OpTime]], shape: Shape, count: int = 15) -> list[dict]:
    """The `count` costliest op names (their events summed per call; median over calls), with op type and bucket."""
    per: dict[tuple[str, str, str], list[float]] = {}
    for call, run in enumerate(runs):
        for op, bucket in zip(run, buckets_of(run, shape)):
            times = per.setdefault((op.name, op.op, bucket), [0.0] * len(runs))
            times[call] += op.us / 1000
    ranked = sorted(((statistics.median(t), key) for key, t in per.items()), reverse=True)[:count]
    return [{"name": name, "op": op, "bucket": bucket, "ms": ms} for ms, (name, op, bucket) in ranked]


# --- collecting the events -------------------------------------------------------------------------------------
Runs = tuple[list[list[OpTime]], list[float]]  # each call's op events, and its seconds with the profiler on


def timed_calls(session, calls: list[tuple[str, list[np.ndarray]]], beside=None) -> list[float]:
    """Each call's seconds, run in order; beside(method, inputs) runs before each (the unprofiled twin)."""
    seconds = []
    for method, inputs in calls:
        if beside is not None:
            beside(method, inputs)
        start = time.perf_counter()
        session.run(method, inputs)
        seconds.append(time.perf_counter() - start)
    return seconds


def ort_runs(model: Path, calls: list[tuple[str, list[np.ndarray]]], threads: int, folder: Path, beside=None) -> Runs:
    """Each call's op events under ONNX Runtime's profiler: the trace's node events ("<node>_kernel_time") split by
    its model_run events, each call's in graph order (node_index: ONNX Runtime runs an op once its inputs are
    ready, the stream masks' ops first; nodes its fusions made come last). The If that runs the method holds its
    branch: the branch's nodes count, not it."""
    from streamfuse.runtime.backends.runners import OnnxRuntimeRunner

    session = OnnxRuntimeRunner(model, threads=threads, profile=folder / "ort")
    seconds = timed_calls(session, calls, beside)
    trace = json.loads(Path(session.session.end_profiling()).read_text())
    runs = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"
    )
    if len(runs) != len(calls):
        raise RuntimeError(f"ONNX Runtime's trace has {len(runs)} runs for {len(calls)} calls")
    nodes = sorted((e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")), key=_ts)
    out: list[list[tuple[int, OpTime]]] = [[] for _ in runs]
    index = 0
    for event in nodes:
        while index < len(runs) and event["ts"] > runs[index][1]:
            index += 1
        if index == len(runs):
            break
        name, method = event["name"][: -len("_kernel_time")], calls[index][0]
        if name == method:  # the taken If: its branch's nodes are the events
            continue
        shapes = event["args"].get("output_type_shape") or [{}]
        dims = next(iter(shapes[0].values()), None)
        op = event["args"].get("op_name", "")
        at = int(event["args"].get("node_index", 0))
        out[index].append((at, OpTime(name.removeprefix(f"{method}/"), op, event["dur"], dims[-1] if dims else None)))
    return [[op for _, op in sorted(run, key=_first)] for run in out], seconds


def _first(pair: tuple[int, OpTime]) -> int:
    return pair[0]


def _ts(event: dict) -> int:
    return event["ts"]


def et_runs(pte: Path, calls: list[tuple[str, list[np.ndarray]]], threads: int, folder: Path, beside=None) -> Runs:
    """Each call's op events from ExecuTorch's ETDump, in call order (one run block per method execution); where the
    runtime records no ETDump (the pip wheel is built without its event tracer), each call's CPU samples by kernel
    symbol (perf_runs)."""
    from streamfuse.runtime.backends.runners import ExecuTorchRunner

    session = ExecuTorchRunner(pte, threads, etdump=True)
    first = timed_calls(session, calls[:1], beside)
    session.write_etdump(str(folder / "et.etdp"), str(folder / "et.debug"))
    if not (folder / "et.etdp").is_file():
        print(NO_ETDUMP, flush=True)
        counts, seconds = perf_runs(session, calls[1:], folder, beside)
        runs = [[OpTime(b, f"perf:{b}", us) for b, us in count.items()] for count in counts]
        return [[], *runs], first + seconds
    seconds = first + timed_calls(session, calls[1:], beside)
    session.write_etdump(str(folder / "et.etdp"), str(folder / "et.debug"))
    from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc

    dump = deserialize_from_etdump_flatcc((folder / "et.etdp").read_bytes())
    out = []
    for block in (block for block in dump.run_data if block.events):
        events = [event.profile_event for event in block.events if event.profile_event is not None]
        out.append(
            [
                OpTime(e.name or str(e.delegate_debug_id_str), e.name or "delegate", (e.end_time - e.start_time) / 1000)
                for e in events
                if e.name not in ("Method::execute", "Method::init", "Program::load_method")
            ]
        )
    return out, seconds


# --- the command -----------------------------------------------------------------------------------------------
COLLECTORS = {"onnxruntime": (ort_runs, "model"), "executorch": (et_runs, "program")}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--artifact", type=Path, required=True, help="exported artifact (streamfuse build)")
    parser.add_argument("--backends", default=",".join(ENGINES), help=f"comma-separated, among {', '.join(ENGINES)}")
    parser.add_argument("--spans", default="300", help="cache slots in use, comma-separated")
    parser.add_argument("--rounds", type=int, default=20, help="profiled (and, apart, unprofiled) calls per graph")
    parser.add_argument("--threads", type=threads_type, default=2, help="CPU threads")
    parser.add_argument("--bucket", type=int, default=None, help="step rows (default: the artifact's largest)")
    parser.add_argument("--json", type=Path, default=None, help="also write the tables as JSON here")
    errors.add_debug_flag(parser)
    return parser.parse_args(argv)


def graphs_of(manifest: dict, bucket: int | None) -> list[str]:
    rows = bucket or max(manifest["graphs"]["buckets"])
    errors.check(
        rows in manifest["graphs"]["buckets"],
        f"--bucket {rows}: the artifact's steps have {manifest['graphs']['buckets']} rows",
    )
    names = ["prefill", "decode", bucket_method("step", rows), bucket_method("greedy_step", rows), "streams"]
    return [name for name in names if name in manifest["graphs"]["methods"]]


def profile(artifact: Artifact, backend: str, graphs: list[str], span: int, rounds: int, threads: int) -> dict:
    """{graph: {bucket: ms, .., profiled, wall, unexplained}} at `span` slots: the profiled calls (the first round
    untimed) and as many unprofiled ones, each round running every graph in both runners back to back."""
    manifest = artifact.manifest
    gamma, vocab = manifest["streams"]["num_streams"], manifest["model"]["vocab_size"]
    inputs = {g: method_inputs(manifest["graphs"]["methods"][g], span, artifact.trees, gamma, vocab) for g in graphs}
    files = artifact.backend_files(backend)
    collect, key = COLLECTORS[backend]
    plain, walls = open_runner(backend, files, threads), {g: [] for g in graphs}

    def beside(method: str, inputs: list[np.ndarray]) -> None:  # the same call unprofiled, just before
        start = time.perf_counter()
        plain.run(method, inputs)
        walls[method].append(time.perf_counter() - start)

    calls = [(g, inputs[g]) for _ in range(rounds + 1) for g in graphs]
    with tempfile.TemporaryDirectory(prefix="op-profile-") as folder:
        runs, seconds = collect(files[key], calls, threads, Path(folder), beside)
    errors.check(
        len(runs) == len(calls) and any(runs[len(graphs) :]),
        f"{backend}'s profiler recorded no op events ({len(runs)} runs for {len(calls)} calls)",
    )
    shape = manifest["model"]["num_layers"], manifest["streams"]["msa_layers"]
    out = {}
    for g in graphs:
        mine = [i for i in range(len(graphs), len(calls)) if calls[i][0] == g]
        table = bucket_table([runs[i] for i in mine], Shape(*shape, g))
        wall, on = 1000 * statistics.median(walls[g][1:]), 1000 * statistics.median(seconds[i] for i in mine)
        out[g] = {**table, "wall, profiler on": on, "wall": wall, "unexplained": wall - table["profiled"]}
        out[g]["events"] = len(runs[mine[0]])
        out[g]["top"] = top_ops([runs[i] for i in mine], Shape(*shape, g))
    return out


ROWS = (*BUCKETS, "profiled", "wall, profiler on", "wall", "unexplained")


def report(backend: str, span: int, threads: int, rounds: int, tables: dict) -> str:
    graphs = list(tables)
    step = next((g for g in graphs if g.startswith("step_")), None)
    greedy = next((g for g in graphs if g.startswith("greedy_step_")), None)
    diffs = [
        (f"{step}-decode", step, "decode"),
        (f"{greedy}-{step}", greedy, step),
        (f"{greedy}-decode", greedy, "decode"),
    ]
    diffs = [(label, a, b) for label, a, b in diffs if a and b]
    head = ["bucket (ms)", *graphs, *(label for label, _, _ in diffs)]
    width = max(12, *(len(h) + 1 for h in head[1:]))
    lines = [
        f"{backend}, {threads} threads, {span} slots: median ms per bucket over {rounds} profiled calls; wall: median "
        f"of {rounds} unprofiled calls (profiler on: of the profiled ones); unexplained = wall - profiled "
        f"(dispatch, what no op event covers; negative where the profiler's own cost per event exceeds it)",
        f"{head[0]:<26}" + "".join(f"{h:>{width}}" for h in head[1:]),
    ]
    for row in ROWS:
        values = [tables[g][row] for g in graphs] + [tables[a][row] - tables[b][row] for _, a, b in diffs]
        if row in BUCKETS and not any(abs(v) >= 0.005 for v in values[: len(graphs)]):
            continue
        lines.append(f"{row:<26}" + "".join(f"{v:>{width}.2f}" for v in values))
    lines.append(f"{'op events per call':<26}" + "".join(f"{tables[g]['events']:>{width}d}" for g in graphs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    errors.check(
        bool(backends) and all(b in ENGINES for b in backends),
        f"--backends takes {', '.join(ENGINES)}, comma-separated; got {args.backends!r}",
    )
    words = [s.strip() for s in args.spans.split(",") if s.strip()]
    errors.check(bool(words) and all(w.isdigit() for w in words), f"--spans takes slot counts, got {args.spans!r}")
    errors.check(args.rounds >= 1, "--rounds must be >= 1")
    artifact = Artifact.open(args.artifact)
    graphs = graphs_of(artifact.manifest, args.bucket)
    capacity = artifact.manifest["graphs"]["capacity"]
    rows = max(artifact.manifest["graphs"]["buckets"] + [artifact.manifest["graphs"]["prefill_chunk"]])
    spans = [int(w) for w in words]
    errors.check(
        all(rows <= s <= capacity - rows for s in spans),
        f"--spans must lie in [{rows}, {capacity - rows}], got {args.spans}",
    )
    results: dict = {}
    for backend in backends:
        errors.check(
            backend in artifact.manifest["files"],
            f"{args.artifact} has no {backend} files (it has {', '.join(artifact.manifest['files'])})",
        )
        for span in spans:
            tables = profile(artifact, backend, graphs, span, args.rounds, args.threads)
            print(report(backend, span, args.threads, args.rounds, tables) + "\n", flush=True)
            results.setdefault(backend, {})[str(span)] = tables
    if args.json:
        meta = {"artifact": str(args.artifact), "threads": args.threads, "rounds": args.rounds}
        args.json.write_text(json.dumps({**meta, "ms": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
