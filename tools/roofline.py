"""streamfuse roofline: projected step cost and speed-up on devices we cannot run on.

A MODEL, not a measurement. A decoding call streams the weights and the KV cache it reads from
memory once, and computes 2 FLOPs per weight and token plus attention over the context; its time
is the larger of the two at the device's published bandwidth and peak compute (a roofline, with no
launch overheads, kernel efficiencies or caches). A tree step of T nodes reads the same weights as
a plain step and computes T times as much, so on a memory-bound device it costs about one plain
step. The artifact's acceptance model gives each candidate tree's expected tokens per step;
projected speed-up = expected tokens x plain time / step time.

    streamfuse roofline --artifact artifacts/dialogsum [--devices jetson-orin-nano-super,apple-m2-ane]

Run on this CPU too (--devices includes the `measured` rows of the artifact's calibrations): the
gap between the model's cost ratio and the measured one says how far to trust the rest.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from streamfuse.runtime.artifact.format import Artifact, ArtifactError
from streamfuse.runtime.speculation.calibration import MAX_TREE_NODES, AcceptanceModel


@dataclass(frozen=True)
class Device:
    bandwidth: float  # bytes/s, published
    flops: float  # FLOP/s at the weights' precision, published (dense)
    weight_bytes: float  # bytes per weight in the format such a device runs (fp16: 2; int8: 1; 4-bit: ~0.56)
    source: str


# Published figures (vendor data sheets and specification pages); dense peak, no sparsity.
DEVICES = {
    "jetson-orin-nano-super": Device(
        102e9,
        16.8e12,
        2.0,
        "Jetson Orin Nano 8 GB Super: LPDDR5 102 GB/s; GPU 67 "
        "INT8 TOPS sparse = 33.5 dense, fp16 half that; fp16 weights",
    ),
    "jetson-agx-orin-64gb": Device(
        204.8e9,
        85e12,
        2.0,
        "Jetson AGX Orin 64 GB: LPDDR5 204.8 GB/s; GPU 170 INT8 TOPS dense, fp16 half that; fp16 weights",
    ),
    "apple-m2-gpu": Device(
        100e9, 3.6e12, 2.0, "Apple M2: unified LPDDR5 100 GB/s; 10-core GPU 3.6 TFLOPS; fp16 weights"
    ),
    "apple-m2-ane": Device(
        100e9, 15.8e12, 2.0, "Apple M2 Neural Engine: 15.8 TOPS (fp16), the same 100 GB/s; fp16 weights"
    ),
    "iphone-15-pro-ane": Device(
        51.2e9, 35e12, 2.0, "A17 Pro Neural Engine: 35 TOPS; LPDDR5-6400 64-bit 51.2 GB/s; fp16 weights"
    ),
    # The machine calibrate measures on, to hold the model against measurements: 2 Zen 4 cores at ~3 GHz,
    # 32 fp32 FLOPs per cycle each; the bandwidth a 24 ms fp32 ExecuTorch plain step implies (540 MB).
    "zen4-2-cores": Device(
        22.5e9,
        192e9,
        4.0,
        "this benchmark VM: 2 Zen 4 cores (192 GFLOPS fp32 peak), "
        "22.5 GB/s as ExecuTorch's fp32 plain step implies; fp32 weights",
    ),
}


@dataclass(frozen=True)
class Shape:
    """What a call moves and computes, from the artifact's manifest."""

    parameters: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int

    def step_seconds(self, device: Device, nodes: int, context: int) -> float:
        kv_bytes = 2 * self.num_layers * self.num_kv_heads * self.head_dim * context * 2  # K and V, fp16
        moved = self.parameters * device.weight_bytes + kv_bytes
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * context  # QK^T and PV per token
        computed = nodes * (2 * self.parameters + attention)
        return max(moved / device.bandwidth, computed / device.flops)


def project(
    acceptance: AcceptanceModel, shape: Shape, device: Device, context: int, max_nodes: int = MAX_TREE_NODES
) -> list[dict]:
    """Per tree size: the best tree's expected tokens, modelled step cost over a plain step, speed-up."""
    plain = shape.step_seconds(device, 1, context)
    rows = []
    for nodes, tree in acceptance.best_trees(max_nodes).items():
        cost = shape.step_seconds(device, nodes, context) / plain
        tokens = acceptance.expected_tokens(tree)
        rows.append(
            {
                "nodes": nodes,
                "tree": tree.to_dict(),
                "expected_tokens": round(tokens, 4),
                "step_cost": round(cost, 4),
                "projected_speedup": round(tokens / cost, 4),
            }
        )
    return rows


def measured(artifact: Artifact) -> dict[str, list[dict]]:
    """The artifact's calibrations, in the same rows (measured step costs; expected tokens)."""
    out = {}
    for backend, data in artifact.manifest["calibration"]["backends"].items():
        out[f"measured: {backend} on {data['device']}"] = [
            {
                "nodes": row["tree"]["num_nodes"],
                "tree": row["tree"],
                "expected_tokens": row["expected_tokens"],
                "step_cost": row["step_cost"],
                "projected_speedup": row["expected_speedup"],
            }
            for row in sorted(data["trees"], key=lambda row: row["tree"]["num_nodes"])
        ]
    return out


def shape_of(artifact: Artifact, num_heads: int | None) -> Shape:
    model = artifact.manifest["model"]
    if "num_parameters" not in model:
        raise ArtifactError(f"{artifact.path} records no parameter count; rebuild it with this streamfuse")
    heads = num_heads or model["hidden_size"] // model["head_dim"]
    return Shape(model["num_parameters"], model["num_layers"], model["num_kv_heads"], model["head_dim"], heads)


def markdown(name: str, rows: list[dict], note: str) -> str:
    best = max(rows, key=lambda row: row["projected_speedup"])
    lines = [
        f"### {name}",
        "",
        note,
        "",
        "| nodes | expected tokens / step | step cost (x plain) | speed-up |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['nodes']}{' (best)' if r is best else ''} | {r['expected_tokens']:.2f} | {r['step_cost']:.2f} | "
        f"{r['projected_speedup']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--artifact", type=Path, required=True, help="artifact with an acceptance model (streamfuse build)"
    )
    parser.add_argument("--devices", default=",".join(DEVICES), help=f"comma-separated, among {', '.join(DEVICES)}")
    parser.add_argument("--context", type=int, default=400, help="KV positions in use (DialogSum: prompt + answer)")
    parser.add_argument("--max-nodes", type=int, default=MAX_TREE_NODES, help="largest tree to project")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [name.strip() for name in args.devices.split(",") if name.strip()]
    unknown = [name for name in names if name not in DEVICES]
    if unknown or args.context < 1 or args.max_nodes < 2:
        problem = (
            f"unknown devices {unknown}: choose among {', '.join(DEVICES)}"
            if unknown
            else "--context must be >= 1 and --max-nodes >= 2"
        )
        raise SystemExit(f"roofline: {problem}")
    try:
        artifact = Artifact.open(args.artifact)
        acceptance = artifact.acceptance
        if acceptance is None:
            raise ArtifactError(f"{args.artifact} has no acceptance model; rebuild it with streamfuse build")
        shape = shape_of(artifact, None)
    except ArtifactError as error:
        raise SystemExit(f"roofline: {error}") from None
    results = {name: project(acceptance, shape, DEVICES[name], args.context, args.max_nodes) for name in names}
    for name, rows in results.items():
        print(markdown(f"{name} (roofline model)", rows, DEVICES[name].source) + "\n")
    for name, rows in measured(artifact).items():
        print(markdown(name, rows, "step costs measured by tools/calibrate.py") + "\n")
    if args.out is not None:
        args.out.write_text(
            json.dumps({"context": args.context, "model": results, "measured": measured(artifact)}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
