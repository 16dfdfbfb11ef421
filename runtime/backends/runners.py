"""Graph runners: run one exported method on one engine, numpy arrays in and out. Each imports its engine
only when used, so a missing optional package is a clear error naming the extra to install, and
only ExecuTorch (whose Python runtime takes torch tensors) brings torch in."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from streamfuse import seams
from streamfuse.runtime.artifact.contract import (
    COMMIT_INPUT,
    EMBEDDING_METADATA,
    METHOD_INPUT,
    METHODS_METADATA,
    TASK_PREFIX,
    cache_of,
    input_names,
    method_output,
    output_names,
)
from streamfuse.runtime.artifact.files import inside
from streamfuse.runtime.artifact.onnx_external import check_external_data
from streamfuse.runtime.backends.static_graph import GraphRunner
from streamfuse.runtime.backends.threads import check_threads
from streamfuse.runtime.ops.kernel_library import KernelUnavailable, load_executorch_kernels, onnxruntime_library_path


class MissingBackend(RuntimeError):
    pass


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingBackend(
            f"{module} is not installed ({error.msg}); install it with `pip install 'streamfuse[{extra}]'`"
        ) from None


_POOL_THREADS: int | None = None  # ExecuTorch's threadpool size, once this process has set it


def set_executorch_threads(threads: int) -> None:
    """Size ExecuTorch's threadpool (XNNPACK sizes its own from the CPU count), before loading a
    program: a program keeps the pool it was loaded with, and resetting the pool under it crashes,
    so the pool is reset only when the count changes."""
    global _POOL_THREADS
    if threads != _POOL_THREADS and seams.reset_executorch_threadpool(threads):  # else: one thread per core
        _POOL_THREADS = threads


class ExecuTorchRunner:
    """The .pte through ExecuTorch's Python runtime (XNNPACK kernels on CPU)."""

    def __init__(self, pte: Path, threads: int | None = None, etdump: bool = False):
        """etdump: record every call's op events (tools/op_profile.py reads them with write_etdump)."""
        check_threads(threads)
        runtime = _require("executorch.runtime", "executorch")
        import torch

        set_executorch_threads(threads or torch.get_num_threads())  # --threads means the same on every backend
        try:  # the programs' attention kernel, registered before a program that calls it loads
            load_executorch_kernels()
        except KernelUnavailable as error:
            raise MissingBackend(str(error)) from None
        self.shares_weights = seams.share_xnnpack_weights()  # one packed copy for all methods, not one each
        self.tensor = torch.from_numpy  # ExecuTorch's Python runtime takes torch tensors: zero-copy views
        program = runtime.Runtime.get().load_program(Path(pte), enable_etdump=etdump)
        self.write_etdump = program.write_etdump_result_to_file  # (etdump path, debug buffer path)
        self.methods = {name: program.load_method(name) for name in program.method_names}
        self.task: list = []  # the bound task's tensors, in name order (bind_task)
        self.name = "executorch:xnnpack"

    def bind_task(self, tensors: dict[str, np.ndarray]) -> None:
        """The task whose tensors every call appends (graphs with task inputs): kept, never copied per call."""
        self.task = [self.tensor(np.ascontiguousarray(tensors[name])) for name in sorted(tensors)]

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        outputs = self.methods[method].execute([*(self.tensor(np.ascontiguousarray(a)) for a in inputs), *self.task])
        return [out.numpy() for out in outputs]  # views: valid until this method runs again


# The providers with kernels for streamfuse's ops (attention, commit_rows, the 4-bit linears), which every exported
# ONNX model calls and which write the host's KV cache in place. Under another provider ONNX Runtime would run them
# on copies of the cache moved between devices, and the rows they write would never reach the host: runners stay
# on these until the ops have kernels elsewhere (runtime/kernels/tree_attention_ort.cpp GetExecutionProviderType).
OP_PROVIDERS = ("CPUExecutionProvider",)


def ort_options(ort, threads: int | None):
    """ONNX Runtime's session options for every session here: `threads` intra-op threads that spin-wait between
    the ops of a call and stop when the call ends. A call is ~1,000 small ops: woken from sleep for each, the
    workers make decode 1.36x slower (`streamfuse call-times`, 300 slots, 2 cores: 9.75 against 7.16 ms); left spinning
    after the call, they would steal the cores from whatever runs next, as OMP_WAIT_POLICY=PASSIVE keeps torch's
    from doing."""
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


class OnnxRuntimeRunner:
    """The artifact's one ONNX model (every method, export/onnx_methods.py) in one InferenceSession:
    one prepacked copy of the weights for all methods, streamfuse's attention kernel registered as a custom
    op, and the host's cache read in place (whole, contiguous arrays go in without a copy). The provider is
    the first of OP_PROVIDERS, named in the trace; asking for another is an error."""

    def __init__(
        self, model: Path, provider: str | None = None, threads: int | None = None, profile: Path | None = None
    ):
        """profile: a file prefix; ONNX Runtime's profiler then records every call (session.end_profiling)."""
        check_threads(threads)
        if provider is not None and provider not in OP_PROVIDERS:
            raise MissingBackend(
                f"onnxruntime provider {provider} cannot run this model: streamfuse's ops in it have "
                f"kernels for {', '.join(OP_PROVIDERS)} only and write the KV cache in place; leave "
                f"the provider unset (it runs on {OP_PROVIDERS[0]})"
            )
        ort = _require("onnxruntime", "onnxruntime")
        provider = provider or OP_PROVIDERS[0]
        options = ort_options(ort, threads)
        if profile is not None:
            options.enable_profiling, options.profile_file_prefix = True, str(profile)
        try:  # the graphs' attention kernel, registered before the model that calls it loads
            options.register_custom_ops_library(str(onnxruntime_library_path()))
        except KernelUnavailable as error:
            raise MissingBackend(str(error)) from None
        if not Path(model).is_file():
            raise FileNotFoundError(f"ONNX model missing: {model}; copy the artifact again or rebuild it")
        check_external_data(Path(model))  # the weights file it names stays in its folder
        self.session = ort.InferenceSession(str(model), options, providers=[provider])
        release_file_pages(Path(model).parent)
        self.ort = ort
        metadata = self.session.get_modelmeta().custom_metadata_map
        methods = json.loads(metadata.get(METHODS_METADATA, "[]"))
        self.index = {method: position for position, method in enumerate(methods)}
        # Graphs that keep the cache in the engine take the commit (contract.COMMIT_INPUT) and return no rows.
        self.engine_cache = any(i.name == COMMIT_INPUT for i in self.session.get_inputs())
        self.outputs = {
            method: [method_output(method, name) for name in output_names(method, self.engine_cache)]
            for method in methods
        }
        self.gathered = {
            name: ort.OrtValue.ortvalue_from_numpy(table)
            for name, table in mapped_tables(Path(model), metadata).items()
        }
        # Inputs a method does not read still need a value: zeros of the declared shape (an open shape: any), and
        # for a cache input (a batched step's keys_b; the single methods' keys) a cache the call was given.
        self.caches = [i.name for i in self.session.get_inputs() if cache_of(i.name) is not None]
        self.placeholders = {
            i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape or []], _DTYPES[i.type])
            for i in self.session.get_inputs()
            if not i.name.startswith(TASK_PREFIX) and i.name not in self.caches and i.name not in self.gathered
        }
        self.task_inputs = {i.name for i in self.session.get_inputs() if i.name.startswith(TASK_PREFIX)}
        self.task: dict = {}  # the bound task's tensors as ONNX Runtime values (bind_task)
        self.name = f"onnxruntime:{provider}"

    def bind_task(self, tensors: dict[str, np.ndarray]) -> None:
        """The task whose tensors every call feeds (graphs with task inputs), made ONNX Runtime values once."""
        if set(tensors) != self.task_inputs:
            missing, extra = sorted(self.task_inputs - set(tensors)), sorted(set(tensors) - self.task_inputs)
            raise ValueError(
                f"the task's tensors do not fit this ONNX model (missing {missing[:3]}, unknown "
                f"{extra[:3]}): the task was built for other graphs; rebuild it with streamfuse build"
            )
        value = self.ort.OrtValue.ortvalue_from_numpy
        self.task = {name: value(np.ascontiguousarray(t)) for name, t in tensors.items()}

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if method not in self.outputs:
            raise ValueError(
                f"the ONNX model has no {method} method (it has {', '.join(self.outputs)}); rebuild the "
                f"artifact with this version"
            )
        if self.task_inputs and not self.task:
            raise ValueError(
                "this ONNX model takes a task's tensors: bind one first (Artifact.task_tensors, bind_task)"
            )
        return self.session.run(self.outputs[method], self._feed(method, inputs))

    def _feed(self, method: str, inputs: list[np.ndarray]) -> dict:
        feed = dict(self.placeholders)
        feed.update(zip(input_names(method, self.engine_cache), inputs))
        given = {cache_of(name): feed[name] for name in self.caches if name in feed}
        feed.update({name: given[cache_of(name)] for name in self.caches if name not in feed and given})
        feed[METHOD_INPUT] = np.array(self.index[method], dtype=np.int64)
        feed.update(self.task)
        feed.update(self.gathered)
        return feed


MADV_DONTNEED = 4  # Linux: drop the pages; a clean file page is read from the file again when next touched


def release_file_pages(folder: Path) -> int:
    """Let the kernel drop this process's resident pages of the files in `folder` from mappings where no page was
    written (Linux; elsewhere a no-op); returns the bytes of the mappings released. ONNX Runtime maps the weights
    file and keeps some initializers its kernels packed (MatMulNBits keeps its scales, 17 MiB of SmolLM2, though
    its packed copy holds them): clean file pages, read from the file again if a kernel ever touches them."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    released = 0
    for mapping in mappings(folder):
        if mapping.written_kb == 0 and libc.madvise(mapping.start, mapping.end - mapping.start, MADV_DONTNEED) == 0:
            released += mapping.end - mapping.start
    return released


class Mapping(NamedTuple):
    start: int
    end: int
    resident_kb: int
    written_kb: int  # private pages written since mapping: no longer the file's


def mappings(folder: Path) -> list[Mapping]:
    """This process's mappings of the files in `folder` (Linux: /proc/self/smaps)."""
    found, inside, target = [], False, os.path.realpath(folder)
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
            if head:
                inside = os.path.dirname(head[3].strip()) == target
                if inside:
                    found.append([int(head[1], 16), int(head[2], 16), 0, 0])
            elif inside and line.startswith(("Rss:", "Anonymous:")):
                found[-1][2 if line.startswith("Rss:") else 3] = int(line.split()[1])
    return [Mapping(*fields) for fields in found]


def mapped_tables(model: Path, metadata: dict) -> dict[str, np.ndarray]:
    """The tables an ONNX model's gathers read as inputs (EMBEDDING_METADATA), each a read-only map of its bytes in
    the weights file beside the model: a page is resident once a token reads it, and ONNX Runtime reads the
    array in place."""
    tables = {}
    for name, place in json.loads(metadata.get(EMBEDDING_METADATA, "{}")).items():
        path = inside(model.parent, place["location"], "the ONNX embedding table's location")
        dtype, shape = np.dtype(place["dtype"]), tuple(place["shape"])
        if not path.is_file() or path.stat().st_size < place["offset"] + dtype.itemsize * int(np.prod(shape)):
            raise FileNotFoundError(f"ONNX weights missing or cut short: {path}; copy the artifact again or rebuild it")
        tables[name] = np.memmap(path, dtype=dtype, mode="r", offset=place["offset"], shape=shape)
    return tables


_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64}


class CoreMLRunner:
    """The multifunction .mlpackage on the Neural Engine (macOS only); functions by the package's names."""

    def __init__(self, package: Path, compute_units: str = "ALL"):
        if platform.system() != "Darwin":
            raise MissingBackend(
                f"Core ML models run on macOS only (this is {platform.system()}); copy the artifact "
                f"to a Mac, or use --backend executorch / onnxruntime here"
            )
        ct = _require("coremltools", "coreml")
        units = getattr(ct.ComputeUnit, compute_units)
        spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
        functions = [f.name for f in spec.description.functions]
        self.models = {
            name: ct.models.MLModel(str(package), function_name=name, compute_units=units) for name in functions
        }
        self.inputs = {name: [i.name for i in m.get_spec().description.input] for name, m in self.models.items()}
        self.outputs = {name: [o.name for o in m.get_spec().description.output] for name, m in self.models.items()}
        self.name = f"coreml:{compute_units.lower()}"

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        feed = {name: a.astype(np.int32) if a.dtype == np.int64 else a for name, a in zip(self.inputs[method], inputs)}
        result = self.models[method].predict(feed)
        # fp16 compute returns fp16 arrays; token ids (greedy_step) come back as int32
        return [np.asarray(result[name], dtype=_host_dtype(result[name])) for name in self.outputs[method]]


def open_runner(backend: str, files: dict[str, Path], threads: int | None = None) -> GraphRunner:
    """The graph runner for one backend's checked files (the artifact manifest's files[backend])."""
    if backend == "executorch":
        return ExecuTorchRunner(files["program"], threads)
    if backend == "onnxruntime":
        return OnnxRuntimeRunner(files["model"], threads=threads)
    if backend == "coreml":
        return CoreMLRunner(files["package"])
    raise ValueError(f"no runtime session for {backend!r} files (built for a device, not for this runtime)")


def _host_dtype(array: np.ndarray) -> type:
    """float32 for floats, int64 for ids: what the host reads whatever the engine computed in."""
    return np.float32 if np.issubdtype(array.dtype, np.floating) else np.int64
