"""A 4-bit linear op of our own on the GGUF's Q4_1 blocks, row-invariant: one C++ kernel
(runtime/kernels/q4_linear.h) for torch (streamfuse::q4_linear, through ctypes) and ONNX Runtime
(streamfuse.Q4Linear), its packing, and a NumPy reference of the same arithmetic, the tests' oracle.

    q4_linear(x [.., K] float32, weights [tiles, K/32, 320] uint8, lora_a [K, r], lora_up [Σ tiles_s·r_s, 16],
              rank_splits [S, 2] int64, out_features N) -> [.., N]

ExecuTorch runs it too (streamfuse::q4_linear.out, in runtime/kernels/tree_attention_et.cpp's library).
weights come from pack() (the GGUF's codes, fp16 scales and minimums, re-laid in tiles of 16 columns: the same
bytes as the file's blocks), the LoRA from pack_lora() (r = 0: none) as (lora_a, lora_up, rank_splits): one
segment (tiles, r). join_lora() puts several layers' LoRA into one node's (export/onnx_pack.py: q / k / v, gate /
up), each segment (its tiles, its rank) keeping its own terms: no zeros for the others' ranks. Activations are
quantized inside the op to int8 per row and block of 32 with their sums; the integer dot products go on AVX-512
VNNI, AVX2 or portable C++, each weight tile-block loaded once for all the call's rows, and a row's bits do not
depend on how many rows the call has, on the thread count or on the path (the header gives the arithmetic).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from streamfuse.runtime.ops import tree_attention as kernels

BLOCK, TILE, TILE_BYTES, SCALES_AT, MINS_AT = 32, 16, 320, 256, 288  # q4_linear.h's constants
PATHS = {"auto": 0, "portable": 1, "avx2": 2, "avx512_vnni": 3}
SCHEMA = (
    "q4_linear(Tensor x, Tensor weights, Tensor lora_a, Tensor lora_up, Tensor rank_splits, int out_features) -> Tensor"
)
OUT_SCHEMA = (
    "q4_linear.out(Tensor x, Tensor weights, Tensor lora_a, Tensor lora_up, Tensor rank_splits, int out_features, *, "
    "Tensor(a!) out) -> Tensor(a!)"
)
# The ONNX Runtime custom op (runtime/kernels/tree_attention_ort.cpp): the torch op's inputs, out_features an
# attribute; x [B, M, K]. In the domain of runtime/ops/tree_attention.py's ops, one library for all.
ONNX_OP = "Q4Linear"


class Q4LinearError(ValueError):
    pass


def tiles_of(out_features: int) -> int:
    return -(-out_features // TILE)


# --- packing -------------------------------------------------------------------------------------
def pack(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_1 codes [N, K] (0..15), scales and mins [N, K/32] (fp16 values) -> [tiles, K/32, 320] uint8, the layout
    of runtime/kernels/q4_linear.h. Columns past N (the last tile's padding) get zero codes, scales and mins."""
    rows, depth = codes.shape
    if depth % BLOCK or scales.shape != (rows, depth // BLOCK) or mins.shape != scales.shape:
        raise Q4LinearError(
            f"pack: codes [N, K] with K a multiple of 32 and scales / mins [N, K/32], got "
            f"{codes.shape}, {scales.shape}, {mins.shape}"
        )
    if codes.max(initial=0) > 15:
        raise Q4LinearError("pack: Q4_1 codes must be in 0..15")
    halves = [np.asarray(v, dtype=np.float32).astype(np.float16) for v in (scales, mins)]
    if any(
        not np.array_equal(h.astype(np.float32), np.asarray(v, np.float32), equal_nan=True)
        for h, v in zip(halves, (scales, mins))
    ):
        raise Q4LinearError("pack: scales and mins must be fp16 values (the GGUF's): packing does not round")
    tiles, blocks = tiles_of(rows), depth // BLOCK
    padded = np.zeros((tiles * TILE, depth), dtype=np.uint8)
    padded[:rows] = codes
    # [tiles, c, blocks, group g (0..7), i (0..3)] -> low nibble groups 0..3, high nibble groups 4..7
    grouped = padded.reshape(tiles, TILE, blocks, 8, 4)
    nibbles = grouped[:, :, :, :4] | (grouped[:, :, :, 4:] << 4)  # [tiles, c, blocks, j, i]
    nibbles = nibbles.transpose(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)  # byte 64j + 4c + i
    out = np.zeros((tiles, blocks, TILE_BYTES), dtype=np.uint8)
    out[..., :SCALES_AT] = nibbles
    for at, half in ((SCALES_AT, halves[0]), (MINS_AT, halves[1])):
        table = np.zeros((tiles * TILE, blocks), dtype=np.float16)
        table[:rows] = half
        out[..., at : at + 2 * TILE] = table.reshape(tiles, TILE, blocks).transpose(0, 2, 1).copy().view(np.uint8)
    return out


def pack_lora(
    down: np.ndarray | None, up: np.ndarray | None, scaling: float, out_features: int, in_features: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A LoRA update (down = A [r, K], up = B [N, r], scaling s) -> (A^T [K, r], s·B^T by tile [tiles·r, 16] (tile
    t's r rows at t·r), rank_splits [[tiles, r]] int64), float32; (None, None) -> rank 0."""
    tiles = tiles_of(out_features)
    splits = np.array([[tiles, 0 if down is None else down.shape[0]]], np.int64)
    if down is None:
        return np.zeros((in_features, 0), np.float32), np.zeros((0, TILE), np.float32), splits
    rank = down.shape[0]
    if down.shape != (rank, in_features) or up.shape != (out_features, rank):
        raise Q4LinearError(
            f"pack_lora: A must be [r, {in_features}] and B [{out_features}, r], got {down.shape} and {up.shape}"
        )
    scaled = np.zeros((tiles * TILE, rank), np.float32)
    scaled[:out_features] = np.asarray(up, np.float32) * np.float32(scaling)
    return (
        np.ascontiguousarray(np.asarray(down, np.float32).T),
        np.ascontiguousarray(scaled.reshape(tiles, TILE, rank).transpose(0, 2, 1).reshape(tiles * rank, TILE)),
        splits,
    )


def join_lora(loras: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layers' (lora_a, lora_up, rank_splits), in the order their tiles are stacked, -> one node's: A's columns side
    by side, U's segments one after another, the segments listed in order. Each column keeps its own layer's terms
    and only those (runtime/kernels/q4_linear.h, Segments)."""
    downs, ups, splits = zip(*loras)
    return (
        np.ascontiguousarray(np.concatenate(downs, axis=1), np.float32),
        np.ascontiguousarray(np.concatenate(ups, axis=0), np.float32),
        np.ascontiguousarray(np.concatenate(splits, axis=0), np.int64),
    )


def unpack(weights: np.ndarray, out_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pack()'s inverse: (codes [N, K] uint8, scales [N, K/32] float32, mins [N, K/32] float32)."""
    tiles, blocks, _ = weights.shape
    nibbles = weights[..., :SCALES_AT].reshape(tiles, blocks, 4, TILE, 4)  # [t, b, j, c, i]
    groups = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)  # [t, b, g, c, i]
    codes = groups.transpose(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks * BLOCK)[:out_features]

    def table(at: int) -> np.ndarray:
        half = weights[..., at : at + 2 * TILE].copy().view(np.float16)  # [t, b, c]
        return half.transpose(0, 2, 1).reshape(tiles * TILE, blocks)[:out_features].astype(np.float32)

    return codes, table(SCALES_AT), table(MINS_AT)


# --- the oracle ----------------------------------------------------------------------------------
def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (q [M, K/32, 32] int32, xd [M, K/32], xs [M, K/32]): the header's quantize_rows."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.clip((blocks * inverse[..., None]).astype(np.float32), -127, 127)
    q = np.where(np.isnan(q), 0, np.rint(q)).astype(np.int32)
    return q, d, (d * q.sum(axis=-1).astype(np.float32)).astype(np.float32)


def reference(
    x: np.ndarray,
    weights: np.ndarray,
    lora_a: np.ndarray,
    lora_up: np.ndarray,
    rank_splits: np.ndarray,
    out_features: int,
) -> np.ndarray:
    """The kernel's arithmetic in NumPy, operation by operation (float32, each a rounding): x [M, K] -> [M, N]; each
    segment's columns sum their own rank terms only."""
    x = np.asarray(x, np.float32)
    codes, scales, mins = unpack(weights, out_features)
    q, xd, xs = quantize_rows(x)
    blocks = codes.reshape(out_features, -1, BLOCK).astype(np.int32)
    sums = np.einsum("mbk,nbk->mnb", q, blocks)  # exact int32 dot products per block
    acc = np.zeros((x.shape[0], out_features), np.float32)
    for b in range(blocks.shape[1]):
        product = (scales[None, :, b] * xd[:, b, None]).astype(np.float32) * sums[:, :, b].astype(np.float32)
        acc = (acc + (product.astype(np.float32) + (mins[None, :, b] * xs[:, b, None]).astype(np.float32))).astype(
            np.float32
        )
    rank = lora_a.shape[1]
    xa = np.zeros((x.shape[0], rank), np.float32)
    for k in range(x.shape[1] if rank else 0):
        xa = (xa + x[:, k, None] * lora_a[k][None]).astype(np.float32)
    lora = np.zeros((x.shape[0], tiles_of(out_features) * TILE), np.float32)
    tile = column = row = 0
    for tiles, own in np.asarray(rank_splits, np.int64).tolist():
        up = lora_up[row : row + tiles * own].reshape(tiles, own, TILE).transpose(1, 0, 2).reshape(own, tiles * TILE)
        part = np.zeros((x.shape[0], tiles * TILE), np.float32)
        for j in range(own):
            part = (part + xa[:, column + j, None] * up[j][None]).astype(np.float32)
        lora[:, tile * TILE : (tile + tiles) * TILE] = part
        tile, column, row = tile + tiles, column + own, row + tiles * own
    return (acc + lora[:, :out_features]).astype(np.float32)


# --- the kernel ----------------------------------------------------------------------------------
@functools.cache
def c_library() -> ctypes.CDLL:
    library = kernels.c_library()
    function = library.streamfuse_q4_linear
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(kernels.View)] + [ctypes.c_int64] * 3 + [ctypes.c_char_p, ctypes.c_int64]
    library.streamfuse_q4_path.restype = ctypes.c_int64
    library.streamfuse_q4_path.argtypes = [ctypes.c_int64]
    return library


def available_paths() -> list[str]:
    """The instruction-set paths this CPU runs (portable always)."""
    return [name for name, code in PATHS.items() if code and c_library().streamfuse_q4_path(code) == code]


def output(op: str, x: np.ndarray, out_features: int) -> np.ndarray:
    """A new out [.., N] for x [.., K] (no columns where N is out of range: the validator names that)."""
    if x.ndim == 0:
        raise Q4LinearError(f"{op}: x must be [.., in_features] (rank 1 to 4), got a scalar")
    return np.empty((*x.shape[:-1], out_features if 0 < out_features <= 1 << 24 else 0), np.float32)


def linear(
    x: np.ndarray,
    weights: np.ndarray,
    lora_a: np.ndarray,
    lora_up: np.ndarray,
    rank_splits: np.ndarray,
    out_features: int,
    path: str = "auto",
    threads: int = 1,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The kernel on NumPy arrays: x [.., K] float32 (rank 1 to 4) -> [.., N] float32, into `out` if given (which
    must be exactly that). x is made a dense float32 copy if it is not one; the other arrays must be of their types
    (the kernel's validator, q4_linear.h, checks every array)."""
    if path not in PATHS:
        raise Q4LinearError(f"q4_linear: path one of {', '.join(PATHS)}, got {path!r}")
    x = np.ascontiguousarray(x, np.float32)
    weights, lora_a, lora_up, rank_splits = (np.ascontiguousarray(a) for a in (weights, lora_a, lora_up, rank_splits))
    out = output("q4_linear", x, out_features) if out is None else out
    arguments = [kernels.views(x, weights, lora_a, lora_up, rank_splits, out), out_features, PATHS[path], threads]
    kernels.run_checked(c_library().streamfuse_q4_linear, arguments, Q4LinearError)
    return out


# --- torch ---------------------------------------------------------------------------------------
def _numpy(op: str, tensor) -> np.ndarray:
    """A CPU tensor's own memory as a NumPy array (out is written through it)."""
    try:
        return tensor.detach().numpy()
    except (TypeError, RuntimeError) as error:  # on a GPU, sparse, of a type NumPy lacks
        raise Q4LinearError(f"{op}: {error}") from None


def define_torch_op(name: str, schema: str, out_schema: str, kernel):
    """A torch.library Library defining streamfuse::<name> and its out variant on CPU tensors, and a fake for
    export: kernel(x [.., K] float32, *weights, out_features, threads, out [.., N]) on NumPy views of the tensors
    (out's own memory: the kernel's validator refuses a wrong one). The Library is returned to be kept alive
    (dropping it unregisters the op)."""
    import torch

    library = torch.library.Library("streamfuse", "FRAGMENT")
    library.define(schema)
    library.define(out_schema)

    def run(x, *args, out=None):
        *weights, out_features = args
        x = _numpy(name, x.float())
        if out is None:
            out = torch.from_numpy(output(name, x, out_features))
        kernel(x, *(_numpy(name, w) for w in weights), out_features, torch.get_num_threads(), _numpy(name, out))
        return out

    library.impl(name, run, "CPU")
    library.impl(f"{name}.out", lambda *args, out: run(*args, out=out), "CPU")
    torch.library.register_fake(
        f"streamfuse::{name}", lambda x, *args: x.new_empty(*x.shape[:-1], args[-1]), lib=library
    )
    return library


@functools.cache
def _torch_library():
    return define_torch_op(
        "q4_linear",
        SCHEMA,
        OUT_SCHEMA,
        lambda x, w, a, u, s, n, threads, out: linear(x, w, a, u, s, n, threads=threads, out=out),
    )


def torch_op():
    """torch.ops.streamfuse.q4_linear: the kernel on CPU tensors, with a fake for export."""
    import torch

    _torch_library()
    return torch.ops.streamfuse.q4_linear.default
