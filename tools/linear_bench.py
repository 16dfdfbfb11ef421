"""streamfuse linear-bench: one linear layer, eager PyTorch vs the torch backend's
oneDNN-packed layer vs ExecuTorch XNNPACK.

Why it exists: on CPUs the cost of a verify pass hinges on how a backend multiplies a few rows
(M = tree nodes) by a weight matrix. Eager PyTorch switches from a matrix-vector kernel at M = 1
to sgemm at M >= 2 and pays ~3x; this shows what backends with prepacked weights do: the torch
backend's PackedLinear (as it runs: eager's kernel for one row of a small weight), its oneDNN
kernel alone, and XNNPACK (needs the `executorch` extra; --no-xnnpack skips it, which the
576 x 49152 LM head needs: XNNPACK crashes on that shape here).

    OMP_WAIT_POLICY=PASSIVE streamfuse linear-bench --rows 1,2,4,8,16 --threads 2
    OMP_WAIT_POLICY=PASSIVE streamfuse linear-bench --out-features 49152 --no-xnnpack --reps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from streamfuse import seams
from streamfuse.export.packed_linear import PackedLinear, packing_available
from streamfuse.runtime.backends.threads import threads_type


def median_us(call, reps: int) -> float:
    samples = []
    for _ in range(reps + 5):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples[5:])


def load_xnnpack():
    """-> (layer, example) -> an XNNPACK-lowered ExecuTorch method of the layer at that shape."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError as error:
        raise SystemExit(
            f"ExecuTorch is not installed ({error}): pip install -e '.[executorch]', or pass --no-xnnpack"
        ) from None
    runtime = Runtime.get()

    def lower(layer, example):
        program = to_edge_transform_and_lower(
            torch.export.export(layer, (example,)), partitioner=[XnnpackPartitioner()]
        )
        return runtime.load_program(program.to_executorch().buffer).load_method("forward")

    return lower


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=576, help="SmolLM2-135M hidden size")
    parser.add_argument("--out-features", type=int, default=1536, help="SmolLM2-135M MLP size")
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated M values (tokens per call)")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument(
        "--xnnpack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time ExecuTorch XNNPACK (default on)",
    )
    args = parser.parse_args(argv)
    if not packing_available("cpu", torch.float32):
        raise SystemExit("this torch build has no oneDNN (mkldnn) CPU kernels to pack for")
    xnnpack_for = load_xnnpack() if args.xnnpack else None
    torch.set_num_threads(args.threads)
    layer = torch.nn.Linear(args.in_features, args.out_features, bias=False).eval()
    packed_layer = PackedLinear(layer)
    print(f"linear {args.in_features}x{args.out_features}, fp32, {args.threads} torch threads")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(1, rows, args.in_features)
        with torch.inference_mode():
            times = {
                "eager": median_us(lambda: layer(x), args.reps),
                "PackedLinear": median_us(lambda: packed_layer(x), args.reps),
                "oneDNN kernel": median_us(
                    lambda: seams.mkldnn_linear(x[0], packed_layer.packed_weight, None), args.reps
                ),
            }
        line = "   ".join(f"{name} {us:7.0f} us" for name, us in times.items())
        if xnnpack_for is not None:
            method = xnnpack_for(layer, x)
            diff = float((method.execute([x])[0] - layer(x)).abs().max())
            line += f"   xnnpack {median_us(lambda: method.execute([x]), args.reps):7.0f} us   max |diff| {diff:.1e}"
        print(f"M={rows:<3} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
