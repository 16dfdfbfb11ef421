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
The libraries are compiled on first use (or by `make build`) into build/kernels/, named by a hash of
their sources; a machine without a C++ compiler gets a one-line error naming what is missing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np

from streamfuse import seams

SOURCES = Path(__file__).resolve().parent / "kernels"
BUILD = Path(__file__).resolve().parents[1] / "build" / "kernels"
# -ffp-contract=off: no fused multiply-add, the reference's arithmetic exactly. The 8 lanes are one AVX2
# register where the CPU has it (the lanes are independent, so the sums do not change; -march=native's
# AVX-512 was slower on a Zen 4).
FLAGS = ["-std=c++20", "-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-Wno-psabi"]


def _arch_flags() -> list[str]:
    try:
        avx2 = platform.machine() in ("x86_64", "AMD64") and " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        avx2 = False
    return ["-mavx2"] if avx2 else []
# The caches are written (store, commit) but not declared so (no `(a!)`): see the module docstring.
SCHEMA = ("tree_attention(Tensor query, Tensor k_cache, Tensor v_cache, int layer, Tensor start, Tensor k_extra, "
          "Tensor v_extra, Tensor visible, float scale, int store) -> Tensor")
OUT_SCHEMA = ("tree_attention.out(Tensor query, Tensor k_cache, Tensor v_cache, int layer, Tensor start, "
              "Tensor k_extra, Tensor v_extra, Tensor visible, float scale, int store, *, Tensor(a!) out) "
              "-> Tensor(a!)")
COMMIT_SCHEMA = "commit_rows(Tensor k_cache, Tensor v_cache, Tensor start, Tensor accepted) -> Tensor"
COMMIT_OUT_SCHEMA = ("commit_rows.out(Tensor k_cache, Tensor v_cache, Tensor start, Tensor accepted, *, "
                     "Tensor(a!) out) -> Tensor(a!)")


# The ONNX Runtime custom ops (runtime/kernels/tree_attention_ort.cpp): inputs in the torch ops' order, but
# TreeAttention's `start` before the extra keys, with `layer`, `scale` and `store` as attributes
# (export/to_onnx.py translates the ops to them).
ONNX_DOMAIN, ONNX_OP, ONNX_COMMIT_OP = "streamfuse", "TreeAttention", "CommitRows"

# The torch op starts its threads per call (~40 us each): one per WORK_PER_THREAD query-key pairs (~0.2 ms).
WORK_PER_THREAD = 32768


class KernelUnavailable(RuntimeError):
    pass


def _compiler() -> str:
    found = shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise KernelUnavailable("the tree attention kernel needs a C++ compiler and none is on PATH: install g++ "
                                "(Debian: apt-get install g++) and run make build")
    return found


def _library_path(name: str, sources: list[str], extra: list[str]) -> Path:
    """Compile `sources` (files under SOURCES) into BUILD/<name>-<hash>.so unless it is there; atomic."""
    digest = hashlib.sha256()
    for source in sorted({*sources, *(header.name for header in SOURCES.glob("*.h"))}):
        digest.update((SOURCES / source).read_bytes())
    flags = FLAGS + _arch_flags()
    digest.update(" ".join(flags + extra).encode())
    target = BUILD / f"{name}-{digest.hexdigest()[:12]}.so"
    if target.is_file():
        return target
    BUILD.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".tmp")
    command = [_compiler(), *flags, *(str(SOURCES / s) for s in sources), "-o", str(partial), *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip()[:300])
        raise KernelUnavailable(f"compiling the tree attention kernel ({name}) failed: {first}")
    partial.replace(target)
    return target


@functools.cache
def c_library() -> ctypes.CDLL:
    """The kernels behind a C ABI (no dependencies), for the torch ops: the attention, runtime/q4_linear.py's
    and runtime/q8_linear.py's."""
    sources = ["tree_attention_c.cpp", "q4_linear_c.cpp", "q8_linear_c.cpp"]
    library = ctypes.CDLL(str(_library_path("libstreamfuse_attention", sources, ["-pthread"])))
    attention = library.streamfuse_tree_attention
    attention.restype = None
    attention.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float] + [ctypes.c_int64] * 2
    commit = library.streamfuse_commit_rows
    commit.restype = ctypes.c_int
    commit.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int64]
    return library


def executorch_library_path() -> Path:
    """The ExecuTorch kernel library, built against the installed executorch wheel's headers and runtime."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise KernelUnavailable("the ExecuTorch tree attention kernel needs executorch: "
                                "pip install 'streamfuse[executorch]'")
    root = Path(list(spec.submodule_search_locations)[0]).resolve()
    runtime = seams.executorch_runtime_library(root)
    if not (root / "include").is_dir() or not runtime.is_file():
        raise KernelUnavailable(f"the executorch wheel at {root} lacks its headers or runtime library; "
                                f"reinstall it: pip install --force-reinstall 'streamfuse[executorch]'")
    include = root / "include"
    extra = ["-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_USE_THREADPOOL", "-DNDEBUG", f"-I{include}",
             f"-I{include / 'executorch' / 'runtime' / 'core' / 'portable_type' / 'c10'}",
             str(runtime), f"-Wl,-rpath,{runtime.parent}"]
    return _library_path("libstreamfuse_attention_et", ["tree_attention_et.cpp"], extra)


def onnxruntime_library_path() -> Path:
    """The ONNX Runtime custom-op library (ONNX_DOMAIN.ONNX_OP). It needs nothing but a C++ compiler: the few
    entries of ONNX Runtime's C API it calls are declared in its source, and the library links nothing."""
    return _library_path("libstreamfuse_attention_ort", ["tree_attention_ort.cpp"], [])


@functools.cache
def load_executorch_kernels() -> None:
    """Register streamfuse::tree_attention.out and commit_rows.out with ExecuTorch's runtime in this process
    (before a program that calls them is loaded). The library links the runtime executorch's pybindings loaded."""
    from executorch.extension.pybindings import portable_lib  # noqa: F401  (loads the runtime first)

    ctypes.CDLL(str(executorch_library_path()), mode=ctypes.RTLD_GLOBAL)


def build_all() -> list[Path]:
    """Compile every library this machine can use (make build / make test); returns their paths."""
    built = [Path(c_library()._name), onnxruntime_library_path()]
    try:
        built.append(executorch_library_path())
    except KernelUnavailable as error:
        if "needs executorch" not in str(error):
            raise
    return built


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


def _in_place_caches(op: str, *caches) -> None:
    """The kernel writes through the caches' pointers: a converted copy would swallow the write."""
    import torch

    if any(c.dtype != torch.float32 or not c.is_contiguous() or c.device.type != "cpu" for c in caches):
        raise ValueError(f"{op}: the caches must be contiguous float32 CPU tensors (it writes into them)")


def _define_attention(library) -> None:
    import torch

    library.define(SCHEMA)
    library.define(OUT_SCHEMA)

    def run(query, k_cache, v_cache, layer, start, k_extra, v_extra, visible, scale, store, out):
        if not 0 <= layer < k_cache.shape[0]:
            raise ValueError(f"tree_attention: layer {layer} is outside the cache's {k_cache.shape[0]} layers")
        if not 0 <= store <= k_extra.shape[2]:
            raise ValueError(f"tree_attention: store {store} is outside [0, {k_extra.shape[2]}] (the extra rows)")
        if store:
            _in_place_caches("tree_attention", k_cache, v_cache)
        k_cache, v_cache = k_cache[layer : layer + 1], v_cache[layer : layer + 1]  # views: no copy
        inputs = [t.contiguous().float() for t in (query, k_cache, v_cache, k_extra, v_extra, visible)]
        query, k_cache, v_cache, k_extra, v_extra, visible = inputs
        _, heads, rows, dim = query.shape
        first = int(start.reshape(-1)[0])
        if not 0 <= first <= k_cache.shape[2]:
            raise ValueError(f"tree_attention: start {first} is outside the cache's {k_cache.shape[2]} slots")
        result = torch.empty(1, rows, heads, dim) if not out.is_contiguous() else out
        c_library().streamfuse_tree_attention(
            *(t.data_ptr() for t in (query, k_cache, v_cache, k_extra, v_extra, visible, result)),
            heads, k_cache.shape[1], rows, dim, k_cache.shape[2], first, k_extra.shape[2], scale, store,
            min(torch.get_num_threads(), 1 + rows * heads * (first + k_extra.shape[2]) // WORK_PER_THREAD))
        if result is not out:
            out.copy_(result)
        return out

    def functional(query, k_cache, v_cache, layer, start, k_extra, v_extra, visible, scale, store):
        _, heads, rows, dim = query.shape
        return run(query, k_cache, v_cache, layer, start, k_extra, v_extra, visible, scale, store,
                   torch.empty(1, rows, heads, dim))

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
        _in_place_caches("commit_rows", k_cache, v_cache)
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError("commit_rows: the caches must be [L, kv, C, d], both of one shape")
        if start.dtype != torch.int64 or start.shape != (1,) or accepted.dtype != torch.int64 or accepted.dim() != 1:
            raise ValueError("commit_rows: start must be a [1] and accepted an [A] int64 tensor")
        nodes, first = accepted.tolist(), int(start[0])
        error = commit_error(k_cache.shape[2], first, nodes)
        if error:
            raise ValueError(error)
        accepted = accepted.contiguous()
        c_library().streamfuse_commit_rows(k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.shape, first,
                                           accepted.data_ptr(), len(nodes))
        return out.copy_(start)

    library.impl("commit_rows", lambda k, v, start, accepted: run(k, v, start, accepted, start.new_empty(1)), "CPU")
    library.impl("commit_rows.out", run, "CPU")
    torch.library.register_fake("streamfuse::commit_rows", lambda k, v, start, accepted: start.new_empty(1),
                                lib=library)


def commit_error(capacity: int, start: int, accepted: list[int]) -> str | None:
    """What is wrong with a commit_rows call (the header's commit_error, with the numbers), or None."""
    n = next((j for j, node in enumerate(accepted) if node < 0), len(accepted))
    nodes = accepted[:n]
    if any(node != -1 for node in accepted[n:]):
        return f"commit_rows: accepted {accepted} must be its nodes >= 0 first, then only -1 padding"
    if any(b <= a for a, b in zip(nodes, nodes[1:])):
        return f"commit_rows: accepted {accepted}'s nodes must be strictly increasing"
    if start < n:
        return f"commit_rows: start {start} is less than the {n} accepted nodes (base = start - n < 0)"
    if start > capacity:
        return f"commit_rows: start {start} is outside the cache's {capacity} slots"
    if n and start - n + nodes[-1] >= capacity:
        row = start - n + nodes[-1]
        return f"commit_rows: accepted node {nodes[-1]} is row {row}, past the cache's {capacity} slots"
    return None


# --- the oracle ----------------------------------------------------------------------------------
LANES = 8
EXP_FLOOR, LOG2E = np.float32(-87.0), np.float32(1.44269504088896341)
LN2_HI, LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_POLY = [np.float32(c) for c in (1.0, 1.0, 0.5, 0.166666672, 0.0416666716, 0.00833333377, 0.00138888892)]


def reference(query, k_cache, v_cache, start: int, k_extra, v_extra, visible, scale: float) -> np.ndarray:
    """The kernel's arithmetic in NumPy float32, key by key (the test oracle; slow); k_cache [1, kv, C, d]."""
    query, k_cache, v_cache, k_extra, v_extra, visible = (np.asarray(a, dtype=np.float32) for a in (
        query, k_cache, v_cache, k_extra, v_extra, visible))
    _, heads, rows, dim = query.shape
    group = heads // k_cache.shape[1]
    out = np.zeros((1, rows, heads, dim), dtype=np.float32)
    for t in range(rows):
        for h in range(heads):
            g = h // group
            keys = [k_cache[0, g, j] for j in range(start)] + [k_extra[0, g, x] for x in range(k_extra.shape[2])
                                                               if visible[t, x] != 0]
            values = [v_cache[0, g, j] for j in range(start)] + [v_extra[0, g, x] for x in range(k_extra.shape[2])
                                                                 if visible[t, x] != 0]
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
    return np.float32(np.float32(np.float32(s[0] + s[1]) + np.float32(s[2] + s[3]))
                      + np.float32(np.float32(s[4] + s[5]) + np.float32(s[6] + s[7])))


def _exp(x: np.float32) -> np.float32:
    """The kernel's exp_poly: n ln2 + r reduction, a degree-6 polynomial, times 2^n; 0 below EXP_FLOOR."""
    clamped = max(x, EXP_FLOOR)
    n = np.floor(np.float32(np.float32(clamped * LOG2E) + np.float32(0.5)))
    r = np.float32(np.float32(clamped - np.float32(n * LN2_HI)) - np.float32(n * LN2_LO))
    p = EXP_POLY[6]
    for c in range(5, -1, -1):
        p = np.float32(np.float32(p * r) + EXP_POLY[c])
    return np.float32(0) if x < EXP_FLOOR else np.float32(np.ldexp(p, int(n)))


if __name__ == "__main__":  # make kernels
    import sys

    try:
        for path in build_all():
            print(f"[kernels] {path}")
    except KernelUnavailable as error:
        sys.exit(f"error: {error}")
