"""Exact attention over the used span of the KV cache, and the cache's upkeep in place: one C++ kernel
(runtime/kernels/tree_attention.h) for torch (ops streamfuse::tree_attention and streamfuse::commit_rows),
ExecuTorch (the same ops' out variants, registered into ExecuTorch's runtime by a library of ours) and ONNX
Runtime (a custom-op library, streamfuse.TreeAttention and streamfuse.CommitRows), and NumPy references of the
same arithmetic, the tests' oracles.

    tree_attention(query [1, heads, rows, d], k_cache / v_cache [L, kv, C, d], layer, start [1],
                   k_extra / v_extra [1, kv, X, d], visible [rows, X], scale, store) -> [1, rows, heads, d]
    commit_rows(k_cache, v_cache, start [1], accepted [A]) -> start (a copy)

Row t attends cache slots [0, start), then the extra keys (the call's own rows) it sees, in that order;
a row's bits do not depend on the call's other rows, its size or the threads (the header says why).
The cache lives in the engine, so no K/V row leaves a call: tree_attention then writes extra rows [0, store)
into slots start.. of `layer` (rows past C dropped), and commit_rows moves the previous step's accepted nodes
(ascending, then -1 padding; n of them) from slots base + accepted[j] to base + j, base = start - n, in every
layer. Neither schema declares these writes: the graphs feed commit_rows' output as every attention's start,
so a step's commit runs before its attention on every engine (they order nodes by data only), and a call's
store touches only slots >= start, which no attention of the same call reads.
The libraries are compiled when streamfuse is built or installed (`make kernels` after editing the sources)
and loaded by runtime/ops/kernel_library.py.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from streamfuse.runtime.ops import kernel_library

# The caches are written (store, commit) but not declared so (no `(a!)`): see the module docstring.
SCHEMA = (
    "tree_attention(Tensor query, Tensor k_cache, Tensor v_cache, int layer, Tensor start, Tensor k_extra, "
    "Tensor v_extra, Tensor visible, float scale, int store) -> Tensor"
)
OUT_SCHEMA = (
    "tree_attention.out(Tensor query, Tensor k_cache, Tensor v_cache, int layer, Tensor start, "
    "Tensor k_extra, Tensor v_extra, Tensor visible, float scale, int store, *, Tensor(a!) out) "
    "-> Tensor(a!)"
)
COMMIT_SCHEMA = "commit_rows(Tensor k_cache, Tensor v_cache, Tensor start, Tensor accepted) -> Tensor"
COMMIT_OUT_SCHEMA = (
    "commit_rows.out(Tensor k_cache, Tensor v_cache, Tensor start, Tensor accepted, *, Tensor(a!) out) -> Tensor(a!)"
)


# The ONNX Runtime custom ops (runtime/kernels/tree_attention_ort.cpp): inputs in the torch ops' order, but
# TreeAttention's `start` before the extra keys, with `layer`, `scale` and `store` as attributes
# (export/to_onnx.py translates the ops to them).
ONNX_DOMAIN, ONNX_OP, ONNX_COMMIT_OP = "streamfuse", "TreeAttention", "CommitRows"

# The torch op starts its threads per call (~40 us each): one per WORK_PER_THREAD query-key pairs (~0.2 ms).
WORK_PER_THREAD = 32768


@functools.cache
def c_library() -> ctypes.CDLL:
    """The kernels behind a C ABI (no dependencies), for the torch ops: the attention, runtime/ops/q4_linear.py's
    and runtime/ops/q8_linear.py's."""
    library = kernel_library.load_c_library()
    attention, commit = library.streamfuse_tree_attention, library.streamfuse_commit_rows  # tree_attention_c.cpp
    attention.restype = commit.restype = ctypes.c_int
    attention.argtypes = [
        ctypes.POINTER(View),
        ctypes.c_int64,
        ctypes.c_double,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
    ]
    commit.argtypes = [ctypes.POINTER(View), ctypes.c_char_p, ctypes.c_int64]
    return library


# --- torch ---------------------------------------------------------------------------------------
@functools.cache
def _torch_library():
    """The ops' torch Library, defined once and kept alive (dropping it unregisters the ops)."""
    import torch

    library = torch.library.Library("streamfuse", "FRAGMENT")
    _define_attention(library)
    _define_commit(library)
    return library


def torch_op():
    """torch.ops.streamfuse.tree_attention: the kernel through ctypes on CPU tensors, a fake for export, and
    the out variant ExecuTorch's lowering turns it into."""
    import torch

    _torch_library()
    return torch.ops.streamfuse.tree_attention.default


def commit_op():
    """torch.ops.streamfuse.commit_rows, defined like torch_op()."""
    import torch

    _torch_library()
    return torch.ops.streamfuse.commit_rows.default


class KernelCallError(ValueError):
    """A call the kernels' validators refused (runtime/kernels/*.h): their one-line message."""


class View(ctypes.Structure):
    """runtime/kernels/boundary.h's View: all that the C ABI's validators know of a tensor."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("sizes", ctypes.c_int64 * 8),
        ("strides", ctypes.c_int64 * 8),
        ("rank", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
    ]


# boundary.h's DType codes by NumPy / torch dtype name (those past int8 only name the type in an error).
DTYPES = {
    "float32": 0,
    "int64": 1,
    "uint8": 2,
    "int8": 3,
    "int32": 5,
    "float16": 6,
    "bfloat16": 7,
    "float64": 8,
    "bool": 9,
}
OTHER_DTYPE, MESSAGE_SIZE = 4, 400


def view(array) -> View:
    """A View of a NumPy array or a torch tensor, its own memory (no copy): the validators check the rest."""
    if isinstance(array, np.ndarray):
        data, shape, item = array.ctypes.data, array.shape, array.itemsize
        strides = [step // item if step % item == 0 else -1 for step in array.strides]  # -1: never dense
        name = array.dtype.name if array.dtype.isnative else "non-native byte order"
    else:
        import torch

        if array.device.type != "cpu" or array.layout != torch.strided:
            raise KernelCallError(
                f"streamfuse's kernels take dense CPU tensors, got a {array.layout} tensor on "
                f"{array.device}: pass tensor.cpu() / .to_dense()"
            )
        data, shape, strides = array.data_ptr(), tuple(array.shape), array.stride()
        name = str(array.dtype).removeprefix("torch.")
    result = View(data=data or None, rank=len(shape), dtype=DTYPES.get(name, OTHER_DTYPE))
    for i, (size, step) in enumerate(list(zip(shape, strides))[:8]):
        result.sizes[i], result.strides[i] = size, step
    return result


def views(*arrays) -> ctypes.Array:
    """The arrays' views in order: a C ABI function's `const View*`."""
    return (View * len(arrays))(*(view(a) for a in arrays))


def run_checked(function, arguments: list, error: type[ValueError] = KernelCallError) -> None:
    """function(*arguments, message, size), a C ABI function that returns 0, or 1 with its one-line error in
    message: raised as `error`."""
    message = ctypes.create_string_buffer(MESSAGE_SIZE)
    if function(*arguments, message, MESSAGE_SIZE):
        raise error(message.value.decode(errors="replace"))


def _threads(query, start, k_extra) -> int:
    """One thread per WORK_PER_THREAD query-key pairs, at most torch's (a guess made before the validator runs)."""
    import torch

    first = int(start.reshape(-1)[0]) if start.numel() == 1 and start.dtype == torch.int64 else 0
    queries = query.numel() // query.shape[-1] if query.dim() and query.shape[-1] else 0
    extra = k_extra.shape[-2] if k_extra.dim() >= 2 else 0
    return max(1, min(torch.get_num_threads(), 1 + queries * (max(first, 0) + extra) // WORK_PER_THREAD))


def _define_attention(library) -> None:
    import torch

    library.define(SCHEMA)
    library.define(OUT_SCHEMA)

    def run(query, k_cache, v_cache, layer, start, k_extra, v_extra, visible, scale, store, out):
        # The inputs only read may be dense copies; the caches (written), start and out go as they are.
        query, k_extra, v_extra, visible = (t.contiguous() for t in (query, k_extra, v_extra, visible))
        tensors = views(query, k_cache, v_cache, start, k_extra, v_extra, visible, out)
        threads = _threads(query, start, k_extra)
        run_checked(c_library().streamfuse_tree_attention, [tensors, layer, scale, store, threads])
        return out

    def functional(query, k_cache, v_cache, layer, start, k_extra, v_extra, visible, scale, store):
        shape = (query.shape[2], query.shape[1], query.shape[3]) if query.dim() == 4 else (0, 0, 0)
        return run(
            query,
            k_cache,
            v_cache,
            layer,
            start,
            k_extra,
            v_extra,
            visible,
            scale,
            store,
            torch.empty(1, *shape, dtype=torch.float32),
        )

    def fake(query, k_cache, v_cache, layer, start, k_extra, v_extra, visible, scale, store):
        _, heads, rows, dim = query.shape
        return query.new_empty(1, rows, heads, dim)

    library.impl("tree_attention", functional, "CPU")
    library.impl("tree_attention.out", run, "CPU")
    torch.library.register_fake("streamfuse::tree_attention", fake, lib=library)


def _define_commit(library) -> None:
    import torch

    library.define(COMMIT_SCHEMA)
    library.define(COMMIT_OUT_SCHEMA)

    def run(k_cache, v_cache, start, accepted, out):
        tensors = views(k_cache, v_cache, start, accepted.contiguous(), out)
        run_checked(c_library().streamfuse_commit_rows, [tensors])  # nothing moves when it raises
        return out

    library.impl("commit_rows", lambda k, v, start, accepted: run(k, v, start, accepted, start.new_empty(1)), "CPU")
    library.impl("commit_rows.out", run, "CPU")
    torch.library.register_fake(
        "streamfuse::commit_rows", lambda k, v, start, accepted: start.new_empty(1), lib=library
    )


# --- the oracle ----------------------------------------------------------------------------------
LANES = 8
EXP_FLOOR, LOG2E = np.float32(-87.0), np.float32(1.44269504088896341)
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_POLY = [np.float32(c) for c in (1.0, 1.0, 0.5, 0.166666672, 0.0416666716, 0.00833333377, 0.00138888892)]


def reference(query, k_cache, v_cache, start: int, k_extra, v_extra, visible, scale: float) -> np.ndarray:
    """The kernel's arithmetic in NumPy float32, key by key (the test oracle; slow); k_cache [1, kv, C, d]."""
    query, k_cache, v_cache, k_extra, v_extra, visible = (
        np.asarray(a, dtype=np.float32) for a in (query, k_cache, v_cache, k_extra, v_extra, visible)
    )
    _, heads, rows, dim = query.shape
    group = heads // k_cache.shape[1]
    out = np.zeros((1, rows, heads, dim), dtype=np.float32)
    for t in range(rows):
        for h in range(heads):
            g = h // group
            keys = [k_cache[0, g, j] for j in range(start)] + [
                k_extra[0, g, x] for x in range(k_extra.shape[2]) if visible[t, x] != 0
            ]
            values = [v_cache[0, g, j] for j in range(start)] + [
                v_extra[0, g, x] for x in range(k_extra.shape[2]) if visible[t, x] != 0
            ]
            scores = [np.float32(_dot(query[0, h, t], key) * np.float32(scale)) for key in keys]
            top = max(scores)
            total, acc = np.float32(0), np.zeros(dim, dtype=np.float32)
            for score, value in zip(scores, values):
                p = _exp(np.float32(score - top))
                total = np.float32(total + p)
                acc = (acc + p * value).astype(np.float32)
            out[0, t, h] = acc / total
    return out


def reference_store(k_cache, v_cache, layer: int, start: int, k_extra, v_extra, store: int) -> None:
    """tree_attention's store, in place: extra rows [0, store) at slots start.. of `layer`, none past C."""
    rows = max(0, min(store, k_cache.shape[2] - start))
    k_cache[layer, :, start : start + rows] = k_extra[0, :, :rows]
    v_cache[layer, :, start : start + rows] = v_extra[0, :, :rows]


def reference_commit(k_cache, v_cache, start: int, accepted) -> None:
    """commit_rows, in place: slot base + j of every layer and KV head <- slot base + accepted[j]."""
    nodes = [int(node) for node in accepted if node >= 0]
    base = start - len(nodes)
    for j, node in enumerate(nodes):
        for cache in (k_cache, v_cache):
            cache[:, :, base + j] = cache[:, :, base + node]


def _dot(a: np.ndarray, b: np.ndarray) -> np.float32:
    lanes = np.zeros(LANES, dtype=np.float32)
    full = len(a) - len(a) % LANES
    for i in range(0, full, LANES):
        lanes = (lanes + a[i : i + LANES] * b[i : i + LANES]).astype(np.float32)
    tail = len(a) - full
    lanes[:tail] = lanes[:tail] + a[full:] * b[full:]
    s = lanes
    return np.float32(
        np.float32(np.float32(s[0] + s[1]) + np.float32(s[2] + s[3]))
        + np.float32(np.float32(s[4] + s[5]) + np.float32(s[6] + s[7]))
    )


def _exp(x: np.float32) -> np.float32:
    """The kernel's exp_poly: n ln2 + r reduction, a degree-6 polynomial, times 2^n; 0 below EXP_FLOOR."""
    clamped = max(x, EXP_FLOOR)
    n = np.floor(np.float32(np.float32(clamped * LOG2E) + np.float32(0.5)))
    r = np.float32(np.float32(clamped - np.float32(n * LN2_HI)) - np.float32(n * LN2_LO))
    p = EXP_POLY[6]
    for c in range(5, -1, -1):
        p = np.float32(np.float32(p * r) + EXP_POLY[c])
    return np.float32(0) if x < EXP_FLOOR else np.float32(np.ldexp(p, int(n)))
