"""python -m streamfuse.tools.linear_bench: one linear layer, eager PyTorch vs the torch backend's
oneDNN-packed layer vs ExecuTorch XNNPACK.

Why it exists: on CPUs the cost of a verify pass hinges on how a backend multiplies a few rows
(M = tree nodes) by a weight matrix. Eager PyTorch switches from a matrix-vector kernel at M = 1
to sgemm at M >= 2 and pays ~3x; this shows what backends with prepacked weights do (the torch
backend's PackedLinear, XNNPACK). Needs the `executorch` extra.

    OMP_WAIT_POLICY=PASSIVE python -m streamfuse.tools.linear_bench --rows 1,2,4,8,16 --threads 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from streamfuse.runtime.backends.packed_linear import PackedLinear, packing_available  # noqa: E402


def median_us(call, reps: int) -> float:
    samples = []
    for _ in range(reps + 5):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples[5:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=576, help="SmolLM2-135M hidden size")
    parser.add_argument("--out-features", type=int, default=1536, help="SmolLM2-135M MLP size")
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated M values (tokens per call)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError as error:
        raise SystemExit(f"ExecuTorch is not installed ({error}): pip install -e '.[executorch]'") from None
    torch.set_num_threads(args.threads)
    runtime = Runtime.get()
    layer = torch.nn.Linear(args.in_features, args.out_features, bias=False).eval()
    packed_layer = PackedLinear(layer) if packing_available("cpu", torch.float32) else None
    print(f"linear {args.in_features}x{args.out_features}, fp32, {args.threads} torch threads")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(1, rows, args.in_features)
        program = to_edge_transform_and_lower(torch.export.export(layer, (x,)), partitioner=[XnnpackPartitioner()])
        method = runtime.load_program(program.to_executorch().buffer).load_method("forward")
        diff = float((method.execute([x])[0] - layer(x)).abs().max())
        with torch.inference_mode():
            eager = median_us(lambda: layer(x), args.reps)
            packed = median_us(lambda: packed_layer(x), args.reps) if packed_layer else float("nan")
        xnnpack = median_us(lambda: method.execute([x]), args.reps)
        print(f"M={rows:<3} eager {eager:7.0f} us   packed {packed:7.0f} us   xnnpack {xnnpack:7.0f} us   "
              f"max |diff| {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
