"""Every use of a dependency's private API, in one module, each seam beside the version it was written
and tested against. A private API can change in any release: tests/test_seams.py fails when a pinned
version moves away from a seam's, so whoever moves the pin re-checks that seam; at run time a seam
used under another version warns once. Nothing else in streamfuse touches these names (the test
greps for them), and nothing here imports streamfuse: every layer may use it.
"""

from __future__ import annotations

import copy
import ctypes
import importlib.metadata
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Seam:
    package: str  # the distribution whose private API it uses
    version: str  # the version it was written and tested against (pyproject pins the same)
    uses: str  # the private names


SEAMS = {
    "executorch-threadpool": Seam("executorch", "1.4.1", "portable_lib._unsafe_reset_threadpool"),
    "executorch-backend-options": Seam(
        "executorch",
        "1.4.1",
        "C++ executorch::runtime::set_option/get_option and "
        "BackendOption's layout (runtime/backend/options.h), through ctypes",
    ),
    "executorch-named-data": Seam(
        "executorch",
        "1.4.1",
        "exir._serialize._named_data_store.NamedDataStore."
        "add_named_data and exir.backend.backend_api.copy, replaced while lowering",
    ),
    "executorch-ir-check": Seam("executorch", "1.4.1", "EdgeCompileConfig(_check_ir_validity=False)"),
    "executorch-linear-config": Seam(
        "executorch",
        "1.4.1",
        "xnnpack partition.config ALL_PARTITIONER_CONFIGS, "
        "LinearConfig._get_weight_deps and utils.is_param_node, subclassed",
    ),
    "executorch-runtime-library": Seam(
        "executorch",
        "1.4.1",
        "extension/pybindings/_portable_lib, linked by our kernel library (its exported runtime and parallel_for)",
    ),
    "executorch-load-program": Seam(
        "executorch",
        "1.4.1",
        "portable_lib._load_for_executorch (a .pte with ExecuTorch's own runners' custom ops: the optimum peer)",
    ),
    "executorch-xnnpack-passes": Seam(
        "executorch",
        "1.4.1",
        "backends.xnnpack._passes.XNNPACKPassManager.__init__ (its default pass list) and "
        "partition.graphs' bilinear_2d / sdpa patterns, replaced while lowering",
    ),
    "torch-node-source": Seam("torch", "2.13.0", "torch.fx.traceback.NodeSource.__init__, replaced while lowering"),
    "torch-mkldnn": Seam("torch", "2.13.0", "torch.ops.mkldnn._reorder_linear_weight and _linear_pointwise"),
    "transformers-attention": Seam("transformers", "5.23.0", "PretrainedConfig._attn_implementation"),
    "coremltools-op-registry": Seam("coremltools", "9.0", "torch_op_registry._TORCH_OPS_REGISTRY and ops._get_inputs"),
}
_WARNED: set[str] = set()


def installed_version(package: str) -> str | None:
    """The installed version without a local tag (torch's 2.13.0+cpu is 2.13.0); None if not installed."""
    try:
        return importlib.metadata.version(package).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def check(name: str) -> None:
    """Warn once when seam `name` runs under another version of its package than it was written for."""
    seam = SEAMS[name]
    found = installed_version(seam.package)
    if found not in (None, seam.version) and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"streamfuse uses {seam.package}'s private {seam.uses}, written for {seam.version}; "
            f"{found} is installed: install {seam.package}=={seam.version} if this step fails",
            RuntimeWarning,
            stacklevel=3,
        )


# --- ExecuTorch runtime ---------------------------------------------------------------------------


def reset_executorch_threadpool(threads: int) -> bool:
    """Size ExecuTorch's threadpool; False where the runtime lacks the call (it keeps one thread per core)."""
    check("executorch-threadpool")
    from executorch.extension.pybindings import portable_lib

    reset = getattr(portable_lib, "_unsafe_reset_threadpool", None)
    if reset is None:
        return False
    reset(threads)
    return True


def executorch_runtime_library(package_root: Path) -> Path:
    """The runtime library ExecuTorch's Python bindings load, which a custom-kernel library links."""
    import sysconfig

    check("executorch-runtime-library")
    return package_root / "extension" / "pybindings" / f"_portable_lib{sysconfig.get_config_var('EXT_SUFFIX')}"


def load_executorch_program(pte: Path):
    """A .pte through the bindings' module loader (all its methods, its own custom ops registered)."""
    check("executorch-load-program")
    from executorch.extension.pybindings import portable_lib

    return portable_lib._load_for_executorch(str(pte))


_BACKEND = b"XnnpackBackend"
_KEY = b"weight_cache_enabled"  # XNNPACKBackend.h: weight_cache_option_key
_SET = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_GET = "_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_BOOL = 0  # index of bool in std::variant<bool, int, std::array<char, 256>>


class _Option(ctypes.Structure):
    """BackendOption: char key[64]; std::variant<bool, int, std::array<char, 256>> value."""

    _fields_ = [
        ("key", ctypes.c_char * 64),
        ("storage", ctypes.c_uint8 * 256),
        ("index", ctypes.c_uint8),
        ("padding", ctypes.c_uint8 * 3),
    ]


class _Span(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t)]


def _option_functions():
    """(set_option, get_option) of each loaded ExecuTorch library that exports the runtime
    (RTLD_NOLOAD: a library not already loaded is skipped, never loaded). Only the runtime that
    the Python bindings registered XNNPACK with knows the backend; the others answer NotFound."""
    from executorch.extension.pybindings import portable_lib

    package = Path(portable_lib.__file__).resolve().parents[2]
    for library in sorted(package.rglob("*.so")) + sorted(package.rglob("*.dylib")):
        try:
            handle = ctypes.CDLL(str(library), mode=os.RTLD_NOLOAD)
            functions = handle[_SET], handle[_GET]
        except (OSError, AttributeError):
            continue
        for function in functions:
            function.argtypes = [ctypes.c_char_p, _Span]
            function.restype = ctypes.c_uint32
        yield functions


def _call(function, option: _Option) -> bool:
    return function(_BACKEND, _Span(ctypes.addressof(option), 1)) == 0


def share_xnnpack_weights(enabled: bool = True) -> bool:
    """XNNPACK's weight cache on (or off) for methods loaded from now on: the methods of a program look
    packed weights up by their named-data key, so equal weights are packed once. ExecuTorch's Python
    bindings expose no backend options, so this goes through the C++ runtime's exported set_option;
    the value is read back with get_option before anything relies on it. True when confirmed."""
    check("executorch-backend-options")
    for set_option, get_option in _option_functions():
        wanted = _Option(key=_KEY, index=_BOOL)
        wanted.storage[0] = int(enabled)
        read = _Option(key=_KEY, index=_BOOL)
        read.storage[0] = 2  # neither value: get_option must overwrite it
        if _call(set_option, wanted) and _call(get_option, read):
            return read.index == _BOOL and read.storage[0] == int(enabled)
    return False


# --- ExecuTorch lowering --------------------------------------------------------------------------


def edge_config_without_ir_check():
    """EdgeCompileConfig without the edge IR check after every pass (~10 % of lowering): the build runs
    each program against the eager model before it ships, which also catches what the check would."""
    check("executorch-ir-check")
    from executorch.exir import EdgeCompileConfig

    return EdgeCompileConfig(_check_ir_validity=False)


def xnnpack_configs_with_input_weights() -> list:
    """XNNPACK's partitioner configs with a linear config that takes an fp32 linear whose weight is a graph input
    (a task's LoRA) as a dynamic-weight fully connected layer, and every other linear as the stock config does
    (constant weights packed once): the stock force_non_static_weights_for_f32_linear makes every fp32 weight
    dynamic, repacking the base's constant ones on every call too."""
    check("executorch-linear-config")
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
    from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType
    from executorch.backends.xnnpack.utils.utils import get_input_node, is_param_node

    class InputWeightLinearConfig(LinearConfig):
        def _get_weight_deps(self, node, ep, precision):
            weight = get_input_node(node, self.weight_idx)
            if precision == ConfigPrecisionType.FP32 and weight.op == "placeholder" and not is_param_node(ep, weight):
                return True, []  # a dynamic weight: not part of the partition's constants
            return super()._get_weight_deps(node, ep, precision)

    return [InputWeightLinearConfig if config is LinearConfig else config for config in ALL_PARTITIONER_CONFIGS]


@contextmanager
def lowering_shares_weights() -> Iterator[None]:
    """While lowering, the methods share one copy of the weights. ExecuTorch's lowering deep-copies
    every method's partitioned program, weights included, before any backend preprocesses them, and
    XNNPACK then gives each method its own NamedDataStore holding a bytes copy of every weight it
    reads, kept until to_executorch merges the stores by key (16 methods of SmolLM2-135M held
    16 + 16 copies of its 540 MB of fp32 weights). Here the copies keep the original tensors
    (preprocessing rewrites graphs, not weights) and equal blobs under one key become one bytes
    object; the program's bytes do not change."""
    check("executorch-named-data")
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.backend import backend_api

    original = NamedDataStore.add_named_data
    seen: dict[str, bytes] = {}

    def add_named_data(self, key, data, *args, **kwargs):
        if isinstance(data, bytes):
            known = seen.setdefault(key, data)
            if known is not data and known == data:
                data = known
        return original(self, key, data, *args, **kwargs)

    NamedDataStore.add_named_data, backend_api.copy = add_named_data, _CopyKeepingWeights()
    try:
        yield
    finally:
        NamedDataStore.add_named_data, backend_api.copy = original, copy


class _CopyKeepingWeights:
    """The `copy` module for ExecuTorch's backend_api while lowering: deepcopy of an ExportedProgram
    keeps its weight and constant tensors (the same objects), and copies the rest."""

    def __getattr__(self, name: str):
        return getattr(copy, name)

    @staticmethod
    def deepcopy(value, memo: dict | None = None):
        from torch.export import ExportedProgram

        memo = {} if memo is None else memo
        if isinstance(value, ExportedProgram):
            for tensor in [*value.state_dict.values(), *value.constants.values()]:
                memo[id(tensor)] = tensor
        return copy.deepcopy(value, memo)


@contextmanager
def shallow_provenance() -> Iterator[None]:
    """While lowering, a node's provenance record shares its history instead of deep-copying it.
    torch.fx (NodeSource) deep-copies each node's whole "from_node" history on every pass, and the
    history grows by one level per pass: with edge decompositions and XNNPACK's 17 passes per
    partition, that copying is ~12 % of lowering a method. The records are only read for debugging
    and never mutated, so sharing them changes no output."""
    check("torch-node-source")
    from torch.fx import traceback

    original = traceback.NodeSource.__init__

    def init(self, node, pass_name: str = "", action=None):
        history = node.meta.pop("from_node", None) if node is not None else None
        original(self, node, pass_name, action)  # copies an empty history
        if history is not None:
            node.meta["from_node"] = history
            self.from_node = list(history)

    traceback.NodeSource.__init__ = init
    try:
        yield
    finally:
        traceback.NodeSource.__init__ = original


@contextmanager
def xnnpack_passes_that_can_act() -> Iterator[None]:
    """While lowering, XNNPACK's preprocess skips the passes that cannot change a partition: each of its 17
    default passes walks or retraces the whole partition, and six of them only rewrite ops our graphs never hold
    (bilinear upsampling, SDPA's decomposed pattern, batch norm, conv1d, PReLU): ~1/8 of lowering a method. A
    pass is skipped only where the partition lacks the ops it rewrites (for a pattern pass: some op of each of its
    patterns, since the subgraph matcher matches a node by its target), so the program's bytes do not change."""
    check("executorch-xnnpack-passes")
    from executorch.backends.xnnpack import _passes
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from executorch.exir.dialects._ops import ops as exir_ops

    aten = exir_ops.edge.aten
    batch_norm = [{aten.native_batch_norm.default}, {aten._native_batch_norm_legit_no_training.default}]
    needs = {  # pass -> op sets, one of which the partition must hold whole for the pass to act
        _passes.ConvertToUpsampleBilinear2d: lambda: [_targets(g) for g in bilinear_2d.get_graphs()],
        _passes.ConvertToSDPAPass: lambda: [_targets(g) for g in sdpa.get_graphs()],
        _passes.FuseBatchNormPass: lambda: batch_norm,
        _passes.DecomposeBatchNorm: lambda: batch_norm,
        _passes.Conv1dUnsqueezePass: lambda: [{aten.convolution.default}],
        _passes.PReLUReshapePass: lambda: [{aten._prelu_kernel.default}],
    }
    manager = _passes.XNNPACKPassManager
    original = manager.__init__

    def init(self, exported_program, passes=None):
        original(self, exported_program, passes)
        if not passes:  # the default list
            held = _targets(exported_program.graph_module)
            self.passes = [p for p in self.passes if p not in needs or any(ops <= held for ops in needs[p]())]

    manager.__init__ = init
    try:
        yield
    finally:
        manager.__init__ = original


def _targets(graph_module) -> set:
    return {node.target for node in graph_module.graph.nodes if node.op == "call_function"}


# --- torch: oneDNN's packed linear ----------------------------------------------------------------

MKLDNN_OPS = ("_reorder_linear_weight", "_linear_pointwise")


def mkldnn_packing_available() -> bool:
    import torch

    return torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in MKLDNN_OPS)


def mkldnn_pack(weight, rows_hint: int):
    """The weight [out, in] in oneDNN's blocked layout for about `rows_hint` rows."""
    check("torch-mkldnn")
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def mkldnn_linear(rows, packed_weight, bias):
    """[M, in] @ packed weight (+ bias) -> [M, out], oneDNN's inner product whatever M is."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed_weight, bias, "none", [], "")


# --- transformers, coremltools --------------------------------------------------------------------


def set_attention_implementation(config, name: str) -> None:
    """Route the attention modules that share `config` to transformers' registered implementation `name`."""
    check("transformers-attention")
    config._attn_implementation = name


def attention_implementation(config) -> str:
    return config._attn_implementation


def register_coreml_alias() -> None:
    """transformers' cache update leaves aten.alias nodes (identities), which coremltools' torch frontend
    does not know: register them as identities."""
    check("coremltools-op-registry")
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY, register_torch_op

    if "alias" in _TORCH_OPS_REGISTRY.name_to_func_mapping:
        return

    @register_torch_op
    def alias(context, node):
        context.add(_get_inputs(context, node, expected=1)[0], node.name)
