"""The LM head on the GGUF's own Q8_0 blocks with our row-invariant kernel (runtime/kernels/q8_linear.h): torch
(streamfuse::q8_tiles, through ctypes), ONNX Runtime (streamfuse.Q8Linear) and ExecuTorch (q8_tiles.out) from one
header, its packing, and a NumPy reference of the same arithmetic, the tests' oracle.

    q8_tiles(x [.., K] float32, codes [tiles·K/32·512] int8, scales [tiles·K/32·16] float32, out_features N)
        -> [.., N]

codes and scales are flat (pack()), so the tied embedding gathers its rows from the same tensors by index
(embedding_index) with no reshaped copy. Activations are quantized in the op as q4_linear's are; every weight
tile-block is loaded once for all the call's rows; a row's bits depend only on the row.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from streamfuse.runtime.ops import q4_linear
from streamfuse.runtime.ops import tree_attention as kernels
from streamfuse.runtime.ops.q4_linear import BLOCK, PATHS, TILE, Q4LinearError, quantize_rows, tiles_of

CODES_BYTES = TILE * BLOCK  # 512 a tile-block
SCHEMA = "q8_tiles(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor"
OUT_SCHEMA = "q8_tiles.out(Tensor x, Tensor codes, Tensor scales, int out_features, *, Tensor(a!) out) -> Tensor(a!)"
ONNX_OP = "Q8Linear"


def pack(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 codes [N, K] int8 and scales [N, K/32] (fp16 values) -> flat (codes int8, scales float32) in the
    header's layout; columns past N are zeros."""
    rows, depth = codes.shape
    if depth % BLOCK or scales.shape != (rows, depth // BLOCK) or codes.dtype != np.int8:
        raise Q4LinearError(
            f"q8 pack: codes [N, K] int8 with K a multiple of 32 and scales [N, K/32], got "
            f"{codes.shape} {codes.dtype} and {scales.shape}"
        )
    tiles, blocks = tiles_of(rows), depth // BLOCK
    padded = np.zeros((tiles * TILE, depth), np.int8)
    padded[:rows] = codes
    # [tiles, c, blocks, g, i] -> [tiles, blocks, g, c, i]: byte 64g + 4c + i of a tile-block
    laid = padded.reshape(tiles, TILE, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    table = np.zeros((tiles * TILE, blocks), np.float32)
    table[:rows] = scales
    return (
        np.ascontiguousarray(laid).reshape(-1),
        np.ascontiguousarray(table.reshape(tiles, TILE, blocks).transpose(0, 2, 1)).reshape(-1),
    )


def embedding_index(out_features: int, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where row n's weights lie in the flat tensors: code (n, k) at code_base[n] + code_offset[k], scale (n, b) at
    scale_base[n] + scale_offset[b] (int64), so the embedding gathers rows from the head's own codes."""
    blocks = in_features // BLOCK
    rows = np.arange(out_features, dtype=np.int64)
    tile, column = rows // TILE, rows % TILE
    k = np.arange(in_features, dtype=np.int64)
    code_offset = (k // BLOCK) * CODES_BYTES + 64 * ((k % BLOCK) // 4) + k % 4
    b = np.arange(blocks, dtype=np.int64)
    return tile * blocks * CODES_BYTES + 4 * column, code_offset, tile * blocks * TILE + column, b * TILE


def unpack(codes: np.ndarray, scales: np.ndarray, out_features: int, in_features: int) -> tuple[np.ndarray, np.ndarray]:
    """pack()'s inverse: (codes [N, K] int8, scales [N, K/32] float32)."""
    code_base, code_offset, scale_base, scale_offset = embedding_index(out_features, in_features)
    return codes[code_base[:, None] + code_offset[None]], scales[scale_base[:, None] + scale_offset[None]]


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, out_features: int) -> np.ndarray:
    """The kernel's arithmetic in NumPy, operation by operation: x [M, K] -> [M, N] float32."""
    x = np.asarray(x, np.float32)
    weights, d = unpack(codes, scales, out_features, x.shape[1])
    q, xd, _ = quantize_rows(x)
    sums = np.einsum("mbk,nbk->mnb", q, weights.reshape(out_features, -1, BLOCK).astype(np.int32))
    acc = np.zeros((x.shape[0], out_features), np.float32)
    for b in range(d.shape[1]):
        scaled = (d[None, :, b] * xd[:, b, None]).astype(np.float32)
        acc = (acc + (scaled * sums[:, :, b].astype(np.float32)).astype(np.float32)).astype(np.float32)
    return acc


@functools.cache
def c_library() -> ctypes.CDLL:
    library = q4_linear.c_library()  # one library: the attention's, with both linear kernels
    function = library.streamfuse_q8_linear
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(kernels.View)] + [ctypes.c_int64] * 3 + [ctypes.c_char_p, ctypes.c_int64]
    return library


def linear(
    x: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
    out_features: int,
    path: str = "auto",
    threads: int = 1,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The kernel on NumPy arrays: x [.., K] float32 (rank 1 to 4) -> [.., N] float32, into `out` if given (which
    must be exactly that); x is made a dense float32 copy if it is not one, codes and scales must be of their
    types (the kernel's validator, q8_linear.h, checks every array)."""
    if path not in PATHS:
        raise Q4LinearError(f"q8_linear: path one of {', '.join(PATHS)}, got {path!r}")
    x = np.ascontiguousarray(x, np.float32)
    codes, scales = np.ascontiguousarray(codes), np.ascontiguousarray(scales)
    out = q4_linear.output("q8_linear", x, out_features) if out is None else out
    arguments = [kernels.views(x, codes, scales, out), out_features, PATHS[path], threads]
    kernels.run_checked(c_library().streamfuse_q8_linear, arguments, Q4LinearError)
    return out


@functools.cache
def _torch_library():
    return q4_linear.define_torch_op(
        "q8_tiles",
        SCHEMA,
        OUT_SCHEMA,
        lambda x, codes, scales, n, threads, out: linear(x, codes, scales, n, threads=threads, out=out),
    )


def torch_op():
    """torch.ops.streamfuse.q8_tiles: the kernel on CPU tensors, with a fake for export."""
    import torch

    _torch_library()
    return torch.ops.streamfuse.q8_tiles.default
