"""The roofline model's arithmetic, worked by hand (it projects devices we cannot run on)."""

import pytest

from streamfuse.tools.roofline import Device, Shape, project

from test_calibration import MODEL

# 100 M weights at 2 bytes over 100 GB/s: 2 ms; 1 layer, 1 KV head of 8 dims, 1 head; context 10.
SHAPE = Shape(parameters=100_000_000, num_layers=1, num_kv_heads=1, head_dim=8, num_heads=1)
MEMORY_BOUND = Device(bandwidth=100e9, flops=1e15, weight_bytes=2.0, source="test")
COMPUTE_BOUND = Device(bandwidth=1e15, flops=2e11, weight_bytes=2.0, source="test")

# (device, nodes) -> seconds: max(bytes / bandwidth, FLOPs / peak)
STEPS = [
    (MEMORY_BOUND, 1, (2e8 + 2 * 8 * 10 * 2) / 100e9),
    (MEMORY_BOUND, 16, (2e8 + 2 * 8 * 10 * 2) / 100e9),  # 16 nodes still read the weights once
    (COMPUTE_BOUND, 1, (2e8 + 4 * 8 * 10) / 2e11),
    (COMPUTE_BOUND, 4, 4 * (2e8 + 4 * 8 * 10) / 2e11),
]


@pytest.mark.parametrize("device, nodes, seconds", STEPS)
def test_a_step_takes_the_longer_of_moving_and_computing(device, nodes, seconds):
    assert SHAPE.step_seconds(device, nodes, context=10) == pytest.approx(seconds)


def test_memory_bound_devices_pay_for_wide_trees_and_compute_bound_ones_do_not():
    wide = {row["nodes"]: row for row in project(MODEL, SHAPE, MEMORY_BOUND, context=10)}
    assert all(row["step_cost"] == pytest.approx(1.0) for row in wide.values())
    assert max(wide.values(), key=lambda r: r["projected_speedup"])["nodes"] == 6  # the first with 2.5 per step
    narrow = project(MODEL, SHAPE, COMPUTE_BOUND, context=10)
    assert all(row["step_cost"] == pytest.approx(row["nodes"]) for row in narrow)
    assert all(row["projected_speedup"] < 1 for row in narrow)  # T times the work for < T tokens


def test_cli_errors_are_one_line(tmp_path):
    from streamfuse.tools.roofline import main

    with pytest.raises(SystemExit, match="unknown devices"):
        main(["--artifact", str(tmp_path), "--devices", "pdp-11"])
    with pytest.raises(SystemExit, match="not an exported artifact"):
        main(["--artifact", str(tmp_path)])
