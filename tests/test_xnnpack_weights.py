"""The methods of one .pte share one copy of the weights: at load, XNNPACK's weight cache
(streamfuse/seams.py, share_xnnpack_weights) keeps one packed copy with the same output bits as one copy per
method; while lowering, lowering_shares_weights (streamfuse/seams.py) keeps one copy with the same program
bytes."""

import importlib.util
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("executorch") is None, reason="executorch not installed (extra: executorch)"
)

METHODS = ("prefill", "decode", "step")
WIDTH = 1024  # 3 layers of 1024 x 1024 fp32: 12 MiB of weights, far above the fixed costs


class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3)))

    def forward(self, x):
        return self.layers(x)


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """One program whose three methods (1, 4 and 8 rows) read the same three weights."""
    from executorch.exir import to_edge_transform_and_lower

    from streamfuse.export.to_executorch import partitioner

    model = Layers().eval()
    programs = {
        name: torch.export.export(model, (torch.randn(rows, WIDTH),), strict=False)
        for name, rows in zip(METHODS, (8, 1, 4))
    }
    path = tmp_path_factory.mktemp("xnnpack_weights") / "model.pte"
    path.write_bytes(to_edge_transform_and_lower(programs, partitioner=[partitioner("xnnpack")]).to_executorch().buffer)
    return path, sum(p.numel() * 4 for p in model.parameters())


LOAD = """
import sys, torch
from executorch.runtime import Runtime
from streamfuse.runtime.backends.runners import set_executorch_threads
from streamfuse.seams import share_xnnpack_weights
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
set_executorch_threads(1)
assert share_xnnpack_weights(sys.argv[2] == "on")
before = rss()
program = Runtime.get().load_program(sys.argv[1])
methods = {name: program.load_method(name) for name in ("prefill", "decode", "step")}
added = rss() - before
torch.manual_seed(1)
outputs = {name: methods[name].execute([torch.randn(rows, 1024)])[0].clone() for name, rows in
           (("prefill", 8), ("decode", 1), ("step", 4))}
torch.save(outputs, sys.argv[3])
print(added)
"""


def load(path, sharing: str, out) -> tuple[int, dict]:
    """RSS added by loading the program and its three methods, in a fresh process, and their outputs."""
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(path), sharing, str(out)], capture_output=True, text=True, check=True
    )
    return int(result.stdout.strip().splitlines()[-1]), torch.load(out, weights_only=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads RSS from /proc")
def test_the_methods_share_one_packed_copy_and_give_the_same_bits(program, tmp_path):
    path, weight_bytes = program
    separate, separate_outputs = load(path, "off", tmp_path / "off.pt")
    shared, shared_outputs = load(path, "on", tmp_path / "on.pt")
    # measured: 3.1x the weight bytes with one packed copy per method, 1.1x shared (the program's
    # unpacked bytes are freed once packed)
    assert separate >= 2.5 * weight_bytes, (separate, weight_bytes)
    assert shared <= 1.5 * weight_bytes, (shared, weight_bytes)
    for name in METHODS:
        assert torch.equal(shared_outputs[name], separate_outputs[name]), name


def test_the_setting_reads_back_and_the_session_turns_it_on(program):
    from streamfuse.runtime.backends.runners import ExecuTorchRunner
    from streamfuse.seams import share_xnnpack_weights

    assert share_xnnpack_weights(False) is True  # True: the runtime confirmed the value written
    session = ExecuTorchRunner(program[0], threads=1)
    assert session.shares_weights is True
    assert share_xnnpack_weights(True) is True


LOWER = """
import contextlib, copy, hashlib, sys, torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend import backend_api
from streamfuse.export.to_executorch import partitioner
from streamfuse.seams import lowering_shares_weights
def peak():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) * 1024
width, methods = int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(3))).eval()
programs = {f"rows_{rows}": torch.export.export(model, (torch.randn(rows, width),), strict=False)
            for rows in range(1, methods + 1)}
original = NamedDataStore.add_named_data
before = peak()
with lowering_shares_weights() if sys.argv[1] == "on" else contextlib.nullcontext():
    buffer = to_edge_transform_and_lower(programs, partitioner=[partitioner("xnnpack")]).to_executorch().buffer
assert NamedDataStore.add_named_data is original and backend_api.copy is copy  # both patches undone
print(peak() - before, hashlib.sha256(buffer).hexdigest())
"""


def lower(sharing: str, methods: int) -> tuple[int, str]:
    """Peak RSS added by lowering `methods` methods over three WIDTH x WIDTH weights in a fresh process,
    and the program's sha256."""
    result = subprocess.run(
        [sys.executable, "-c", LOWER, sharing, str(WIDTH), str(methods)], capture_output=True, text=True, check=True
    )
    added, digest = result.stdout.strip().splitlines()[-1].split()
    return int(added), digest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads peak RSS from /proc")
def test_lowering_keeps_one_copy_of_the_weights_and_writes_the_same_program():
    weight_bytes = 3 * WIDTH * WIDTH * 4
    separate, separate_program = lower("off", methods=8)
    shared, shared_program = lower("on", methods=8)
    assert shared_program == separate_program
    # measured: 18.6x the weights at the peak with copies per method (ExecuTorch's deep copies of each
    # method's program, XNNPACK's data stores), 5.1x with them shared
    assert separate >= 12 * weight_bytes, (separate, weight_bytes)
    assert shared <= 7 * weight_bytes, (shared, weight_bytes)
