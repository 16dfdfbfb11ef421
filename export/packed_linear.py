"""oneDNN-prepacked linear layers: the torch backend's CPU kernels for multi-row steps.

Eager F.linear on a CPU runs a matrix-vector kernel for one row and, from two rows up, an sgemm
that repacks the whole weight on every call. A 4-node tree step costs ~3x a plain step with it, and the
LM head (49,152 x 576) alone takes ~10 ms at one row and 15-21 ms at 2-16 rows. A weight
packed once for oneDNN's inner product makes a few rows cost little more than one (4-6 ms for
that head; `streamfuse latency --kernels packed|eager` times whole steps).
At one row F.linear's matrix-vector kernel stays, being fastest for the decoder's layers,
except on weights as large as the LM head, which oneDNN streams faster: plain decoding gets
that too, so the baseline stays the best this backend can do. `streamfuse
linear-bench` times all three (eager, this layer, the packed kernel alone);
docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamfuse import seams

KERNELS = ("auto", "packed", "eager")
ROWS_HINT = 4  # oneDNN picks its weight layout for about this many rows; tree steps use 2-16
ONE_ROW_PACKED_MIN_ELEMENTS = 1 << 23  # weights this large (the LM head) run packed even for one row


def packing_available(device: str, dtype: torch.dtype) -> bool:
    """oneDNN's packing and inner-product ops are private to torch (streamfuse/seams.py): a build without
    them runs eager."""
    return device == "cpu" and dtype == torch.float32 and seams.mkldnn_packing_available()


def resolve_kernels(kernels: str, device: str, dtype: torch.dtype) -> str:
    """ "auto" -> "packed" where oneDNN can pack (fp32 on a CPU), else "eager"."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    available = packing_available(device, dtype)
    if kernels == "packed" and not available:
        raise ValueError(f"packed kernels need fp32 on a CPU with oneDNN (got {device}, {dtype}); pass kernels='eager'")
    if kernels == "auto":
        return "packed" if available else "eager"
    return kernels


class PackedLinear(nn.Module):
    """nn.Linear's function with a oneDNN-packed copy of the weight, used for calls of two or more
    rows, and for one row too when the weight is head-sized."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        # Derived from weight, in oneDNN's blocked layout; not a parameter, never saved.
        self.packed_weight = seams.mkldnn_pack(linear.weight.detach(), ROWS_HINT)
        self.one_row_packed = linear.weight.numel() >= ONE_ROW_PACKED_MIN_ELEMENTS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= 1 and not self.one_row_packed:
            return F.linear(x, self.weight, self.bias)
        out = seams.mkldnn_linear(x.reshape(rows, x.shape[-1]), self.packed_weight, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])
