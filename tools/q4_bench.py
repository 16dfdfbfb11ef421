"""streamfuse q4-bench: what M rows cost a 4-bit linear, ours against the forms the artifact
runs, at SmolLM2-135M's shapes with random Q4_1 weights and a rank-32 LoRA (time does not depend on the
weights' values; --scope call puts the LoRA on the top 10 layers, as the default build does).

  ours         streamfuse.Q4Linear in ONNX Runtime (runtime/ops/q4_linear.py): one node, LoRA inside (a packed
               node's siblings each their own segment of it); the Q8_0 LM head on streamfuse.Q8Linear
               (runtime/ops/q8_linear.py)
  matmulnbits  ONNX Runtime's MatMulNBits (4 bits, accuracy level 4) + the fp32 low-rank term (block sums and
               LoRA: MatMul, MatMul, Add), the 4 nodes a q4-native ONNX linear takes without our op;
               the head as MatMulNBits (8 bits)
  zero_blocks  ours with a packed node's LoRA as one segment: the siblings' ranks side by side and U
               block-diagonal, exact zeros for the others' ranks (the packed form before segments), for A/B

--scope layer times each linear of a decoder layer alone (q/k/v packed, gate/up packed, as the graphs hold
them: each sibling its own rank-32 LoRA) and the LM head; --scope call puts every linear of the 30 layers and
the head into one graph (~97 MB of codes: each call streams them from memory as a real call does), the linear
part of a whole call. Forms alternate call by call, fixed threads; medians in microseconds and each row count's
cost in 1-row calls, the median of the rounds' ratios first form / last; the fp32 LoRA bytes our op reads a call.

    OMP_WAIT_POLICY=PASSIVE streamfuse q4-bench --scope layer --rows 1,2,4,8,16,64 --threads 2
    OMP_WAIT_POLICY=PASSIVE streamfuse q4-bench --scope call --rows 1,2,4,8,16,64 --threads 2
    OMP_WAIT_POLICY=PASSIVE streamfuse q4-bench --scope call --rows 1,4 --forms ours,zero_blocks --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.ops import q4_linear as q4

HIDDEN, MLP, LAYERS, RANK, ADAPTED = 576, 1536, 30, 32, 10  # the default build's LoRA: rank 32, top 10 layers
VOCAB = 49152
# (name, in_features, siblings' out_features): a decoder layer's linears as the graphs hold them (q/k/v and
# gate/up packed)
LINEARS = [
    ("qkv", HIDDEN, (HIDDEN, 192, 192)),
    ("o", HIDDEN, (HIDDEN,)),
    ("gate_up", HIDDEN, (MLP, MLP)),
    ("down", MLP, (HIDDEN,)),
]


def random_layer(rng, n: int, k: int, rank: int = RANK) -> dict:
    """Q4_1 codes, fp16 scales and minimums like a real layer's, and a LoRA: every form's inputs."""
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, (n, k // 32)).astype(np.float16).astype(np.float32)
    mins = (-scales * rng.uniform(6, 10, scales.shape)).astype(np.float16).astype(np.float32)
    down = (rng.standard_normal((rank, k)) * 0.02).astype(np.float32)  # rank 0: no LoRA
    up = (rng.standard_normal((n, rank)) * 0.02).astype(np.float32)
    return {
        "codes": codes,
        "scales": scales,
        "mins": mins,
        "down": down,
        "up": up,
        "n": n,
        "k": k,
        "parts": [(n, rank)],
    }


def packed_layer(rng, widths: tuple[int, ...], k: int, rank: int = RANK) -> dict:
    """Siblings on one input, each with a LoRA of `rank`, as one packed layer (stacked())."""
    return stacked([random_layer(rng, n, k, rank) for n in widths])


def stacked(layers: list[dict]) -> dict:
    """Siblings on one input as one packed layer: weights stacked, ranks side by side, `up` block-diagonal (each
    sibling's B in its own columns); `parts` [(out_features, rank)] keeps each sibling's share."""
    packed = {name: np.concatenate([layer[name] for layer in layers]) for name in ("codes", "scales", "mins", "down")}
    parts = [part for layer in layers for part in layer["parts"]]
    up = np.zeros((sum(n for n, _ in parts), sum(r for _, r in parts)), np.float32)
    column = rank = 0
    for layer in layers:
        n, r = layer["up"].shape
        up[column : column + n, rank : rank + r] = layer["up"]
        column, rank = column + n, rank + r
    return {**packed, "up": up, "n": column, "k": layers[0]["k"], "parts": parts}


def lora_of(layer: dict, form: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The op's (lora_a, lora_up, rank_splits): each sibling its own segment, or one for all (zero_blocks)."""
    if form == "zero_blocks":
        return q4.pack_lora(layer["down"], layer["up"], 2.0, layer["n"], layer["k"])
    loras, column, rank = [], 0, 0
    for n, r in layer["parts"]:
        down, up = layer["down"][rank : rank + r], layer["up"][column : column + n, rank : rank + r]
        loras.append(q4.pack_lora(down, up, 2.0, n, layer["k"]))
        column, rank = column + n, rank + r
    return q4.join_lora(loras)


def lora_bytes(layers: list[dict], form: str) -> int:
    """The fp32 LoRA (A and U) a call of the op reads."""
    return sum(a.nbytes + u.nbytes for a, u, _ in (lora_of(layer, form) for layer in layers if "parts" in layer))


def head_layer(rng, n: int = VOCAB, k: int = HIDDEN) -> dict:
    """Q8_0 codes and fp16 scales like the tied head's."""
    codes = rng.integers(-127, 128, (n, k), dtype=np.int8)
    scales = rng.uniform(1e-4, 1e-3, (n, k // 32)).astype(np.float16).astype(np.float32)
    return {"kind": "q8", "codes": codes, "scales": scales, "n": n, "k": k}


def _nodes_ours(layer: dict, x: str, out: str, prefix: str, form: str = "ours") -> tuple[list, list]:
    from onnx import helper, numpy_helper

    from streamfuse.runtime.ops import q8_linear

    if layer.get("kind") == "q8":
        codes, scales = q8_linear.pack(layer["codes"], layer["scales"])
        inits = [numpy_helper.from_array(codes, f"{prefix}.codes"), numpy_helper.from_array(scales, f"{prefix}.scales")]
        node = helper.make_node(
            q8_linear.ONNX_OP, [x, *(i.name for i in inits)], [out], domain="streamfuse", out_features=layer["n"]
        )
        return [node], inits

    weights = q4.pack(layer["codes"], layer["scales"], layer["mins"])
    arrays = {"weights": weights, **dict(zip(("lora_a", "lora_up", "rank_splits"), lora_of(layer, form)))}
    inits = [numpy_helper.from_array(a, f"{prefix}.{name}") for name, a in arrays.items()]
    node = helper.make_node(
        q4.ONNX_OP, [x, *(i.name for i in inits)], [out], domain="streamfuse", out_features=layer["n"]
    )
    return [node], inits


def _nodes_matmulnbits(layer: dict, x: str, out: str, prefix: str) -> tuple[list, list]:
    """The q4-native artifact's linear: MatMulNBits on d·(q - 8) + (x · [S | A^T]) · [m + 8d ; s·B^T]."""
    from onnx import helper, numpy_helper

    from streamfuse.export.low_bit import pack_nibbles

    n, k = layer["n"], layer["k"]
    if layer.get("kind") == "q8":  # the head as the artifact held it: codes q + 128, MatMulNBits' default zero point
        codes = (layer["codes"].astype(np.int16) + 128).astype(np.uint8).reshape(n, k // 32, 32)
        inits = [
            numpy_helper.from_array(codes, f"{prefix}.codes"),
            numpy_helper.from_array(layer["scales"].reshape(-1), f"{prefix}.scales"),
        ]
        return [
            helper.make_node(
                "MatMulNBits",
                [x, *(i.name for i in inits)],
                [out],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=8,
                block_size=32,
                accuracy_level=4,
            )
        ], inits
    groups = k // 32
    zero_points = np.full((n, (groups + 1) // 2), 8 | (8 << 4), np.uint8)
    sums = np.repeat(np.eye(groups, dtype=np.float32), 32, axis=0)
    left = np.concatenate([sums, layer["down"].T], axis=1)
    right = np.concatenate([(layer["mins"] + 8 * layer["scales"]).T, layer["up"].T * 2.0], axis=0)
    arrays = {
        "packed": pack_nibbles(layer["codes"]),
        "scales": layer["scales"].reshape(-1),
        "zero_points": zero_points.reshape(-1),
        "left": left,
        "right": right.astype(np.float32),
    }
    inits = [numpy_helper.from_array(np.ascontiguousarray(a), f"{prefix}.{name}") for name, a in arrays.items()]
    names = [i.name for i in inits]
    nodes = [
        helper.make_node(
            "MatMulNBits",
            [x, *names[:3]],
            [f"{prefix}.base"],
            domain="com.microsoft",
            K=k,
            N=n,
            bits=4,
            block_size=32,
            accuracy_level=4,
        ),
        helper.make_node("MatMul", [x, names[3]], [f"{prefix}.low"]),
        helper.make_node("MatMul", [f"{prefix}.low", names[4]], [f"{prefix}.term"]),
        helper.make_node("Add", [f"{prefix}.base", f"{prefix}.term"], [out]),
    ]
    return nodes, inits


FORMS = {
    "ours": _nodes_ours,
    "matmulnbits": _nodes_matmulnbits,
    "zero_blocks": lambda *args: _nodes_ours(*args, form="zero_blocks"),
}


def onnx_model(layers: list[dict], form: str) -> bytes:
    """One graph holding `layers`, each reading input x<K> [1, M, K] and writing its own output."""
    from onnx import TensorProto, helper

    nodes, inits, outputs = [], [], []
    widths = sorted({layer["k"] for layer in layers})
    for index, layer in enumerate(layers):
        made, weights = FORMS[form](layer, f"x{layer['k']}", f"y{index}", f"l{index}")
        nodes += made
        inits += weights
        outputs.append(helper.make_tensor_value_info(f"y{index}", TensorProto.FLOAT, [1, "M", layer["n"]]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, "M", k]) for k in widths]
    graph = helper.make_graph(nodes, "q4_bench", inputs, outputs, inits)
    opsets = [
        helper.make_opsetid(domain, version) for domain, version in (("", 18), ("com.microsoft", 1), ("streamfuse", 1))
    ]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def onnx_session(model: bytes, threads: int):
    """An ONNX Runtime session as the artifact's engine makes one (its thread settings, our op library)."""
    import onnxruntime as ort

    from streamfuse.runtime.backends.runners import ort_options
    from streamfuse.runtime.ops.kernel_library import onnxruntime_library_path

    options = ort_options(ort, threads)
    options.register_custom_ops_library(str(onnxruntime_library_path()))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def time_interleaved(calls: dict, reps: int) -> tuple[dict[str, float], float]:
    """Median microseconds of each call, the calls alternating (a few warm-up rounds first), and the median of each
    round's ratio first call / last call (what a shared machine's changing load disturbs least)."""
    samples = {name: [] for name in calls}
    for round_ in range(reps + 3):
        for name, call in list(calls.items())[:: 1 if round_ % 2 else -1]:  # ABBA: neither goes first always
            start = time.perf_counter()
            call()
            if round_ >= 3:
                samples[name].append(time.perf_counter() - start)
    first, *_, last = samples.values()
    paired = statistics.median(a / b for a, b in zip(first, last))
    return {name: 1e6 * statistics.median(values) for name, values in samples.items()}, paired


def sweep(layers: list[dict], rows_list: list[int], threads: int, reps: int, forms: list[str]) -> list[dict]:
    sessions = {form: onnx_session(onnx_model(layers, form), threads) for form in forms}
    for form in (f for f in forms if f != "matmulnbits"):
        print(f"  {form}: {lora_bytes(layers, form) / 1e6:.2f} MB of fp32 LoRA read a call", flush=True)
    rng, results = np.random.default_rng(1), []
    for rows in rows_list:
        feeds = {
            f"x{k}": rng.standard_normal((1, rows, k)).astype(np.float32) for k in {layer["k"] for layer in layers}
        }
        calls = {form: (lambda s=session: s.run(None, feeds)) for form, session in sessions.items()}
        us, paired = time_interleaved(calls, reps)
        results.append({"rows": rows, "us": us, "paired": paired})
        print(
            f"  M={rows:<3} " + "   ".join(f"{name} {us:8.0f} us" for name, us in results[-1]["us"].items()), flush=True
        )
    return results


def table(results: list[dict]) -> str:
    names = list(results[0]["us"])
    lines = [
        "| rows | " + " | ".join(f"{n} µs (x 1 row)" for n in names) + f" | {names[0]} / {names[-1]} (paired) |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    one = results[0]["us"]
    for result in results:
        us = result["us"]
        cells = [f"{us[n]:.0f} ({us[n] / one[n]:.2f})" for n in names]
        lines.append(f"| {result['rows']} | " + " | ".join(cells) + f" | {result['paired']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scope", choices=("layer", "call"), default="layer")
    parser.add_argument("--rows", default="1,2,4,8,16,64", help="comma-separated row counts (M)")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--forms", default="ours,matmulnbits", help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--out", type=Path, help="write q4_bench.json and q4_bench.md here")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise SystemExit(f"error: --rows must be comma-separated integers, got {args.rows!r}") from None
    if not rows or min(rows) < 1 or args.threads < 1 or args.threads > 256:
        raise SystemExit("error: --rows must be >= 1 and --threads in [1, 256]")
    forms = args.forms.split(",")
    if len(forms) < 2 or not set(forms) <= set(FORMS):
        raise SystemExit(f"error: --forms must name two or more of {', '.join(FORMS)}, got {args.forms!r}")
    rng = np.random.default_rng(0)
    report = {
        "scope": args.scope,
        "threads": args.threads,
        "reps": args.reps,
        "path": q4.available_paths()[-1],
        "rank": RANK,
        "forms": forms,
        "results": {},
    }
    print(f"q4_bench --scope {args.scope}, {args.threads} threads, kernel path {report['path']}")
    if args.scope == "layer":
        for name, k, widths in LINEARS:
            print(f"{name}: {k} -> {' + '.join(map(str, widths))}")
            report["results"][name] = sweep([packed_layer(rng, widths, k)], rows, args.threads, args.reps, forms)
        print(f"head: {HIDDEN} -> {VOCAB} (Q8_0)")
        report["results"]["head"] = sweep([head_layer(rng)], rows, args.threads, args.reps, forms)
    else:
        layers = [
            packed_layer(rng, widths, k, RANK if index >= LAYERS - ADAPTED else 0)
            for index in range(LAYERS)
            for _, k, widths in LINEARS
        ] + [head_layer(rng)]
        print(f"every linear of {LAYERS} layers and the head ({len(layers)} nodes in one graph)")
        report["results"]["call"] = sweep(layers, rows, args.threads, args.reps, forms)
    markdown = "\n\n".join(f"{name}\n\n{table(results)}" for name, results in report["results"].items())
    print(markdown)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "q4_bench.json").write_text(json.dumps(report, indent=1))
        (args.out / "q4_bench.md").write_text(markdown + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
