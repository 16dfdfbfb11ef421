"""ONNX: every method in one model (export/onnx_methods.py), its weights in one file beside it.

The K / V cache is an input per layer (per_layer_cache). Each method is exported through
torch.export (the dynamo exporter) into a scratch folder; the graphs then become the branches of
one model whose initializers are each distinct tensor once, and every large initializer moves
into `weights.bin` (page-aligned, so ONNX Runtime maps it rather than reads it).
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse.export.onnx_methods import combine_methods, strip_debug_info
from streamfuse.runtime.backends.static_graph import CACHE_INPUTS, SPAN_QUANTUM, layer_input

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 4096  # page-aligned offsets so onnxruntime can map the weights
INLINE_BYTES = 1024  # small tensors stay inside the graph


def export_onnx(modules: dict[str, nn.Module], inputs: dict[str, tuple], input_names: dict[str, list[str]],
                output_names: dict[str, list[str]], folder: Path) -> tuple[str, str]:
    """Write model.onnx (the methods of `modules`) and weights.bin into `folder`; returns their names."""
    import onnx

    folder = Path(folder)
    models = {}
    with tempfile.TemporaryDirectory(prefix="onnx-", dir=folder) as scratch:
        for name, module in modules.items():
            args, names = per_layer_cache(inputs[name], input_names[name])
            program = torch.export.export(module, args, strict=False, dynamic_shapes=cache_span(args, module))
            exported = torch.onnx.export(program, (), dynamo=True, input_names=names,
                                         output_names=output_names[name], optimize=True, verbose=False,
                                         custom_translation_table=custom_translations())
            exported.save(str(Path(scratch) / f"{name}.onnx"), external_data=True)
            models[name] = onnx.load(str(Path(scratch) / f"{name}.onnx"), load_external_data=True)
            strip_debug_info(models[name])
    model = combine_methods(models)
    share_weights(model, folder / WEIGHTS_FILE)
    onnx.save_model(model, str(folder / MODEL_FILE))
    return MODEL_FILE, WEIGHTS_FILE


def per_layer_cache(args: tuple, names: list[str]) -> tuple[tuple, list[str]]:
    """The graphs take the K / V cache as one input per layer (runtime/backends/static_graph.py
    CACHE_INPUTS): [L, kv, C, d] -> a list of L [1, kv, C, d] tensors (runtime/backends/graph_passes.py split_cache
    reads either), named <name>_<layer>."""
    flat_args, flat_names = [], []
    for name, value in zip(names, args):
        if name in CACHE_INPUTS:
            flat_args.append([value[layer : layer + 1].clone() for layer in range(value.shape[0])])
            flat_names += [layer_input(name, layer) for layer in range(value.shape[0])]
        else:
            flat_args.append(value)
            flat_names.append(name)
    return tuple(flat_args), flat_names


def cache_span(args: tuple, module: nn.Module | None = None) -> tuple | None:
    """torch.export dynamic_shapes for `args` (per_layer_cache's): the cache rows dim, SPAN_QUANTUM up to C rows
    (the host passes static_graph.span_rows); None (static) for a cache of at most SPAN_QUANTUM rows. A module
    taking `*args` (export/task_inputs.py TaskInputs) gets them as its one argument."""
    cache = next(arg for arg in args if isinstance(arg, list))
    if cache[0].shape[2] <= SPAN_QUANTUM:
        return None
    span = torch.export.Dim.DYNAMIC(min=SPAN_QUANTUM, max=cache[0].shape[2])
    shapes = tuple([{2: span}] * len(arg) if isinstance(arg, list) else None for arg in args)
    parameters = list(inspect.signature(module.forward).parameters.values()) if module is not None else []
    return (shapes,) if [p.kind for p in parameters] == [inspect.Parameter.VAR_POSITIONAL] else shapes


def share_weights(model, weights_path: Path) -> None:
    """Move the model's large initializers into one file, page-aligned."""
    from onnx import TensorProto
    from onnx.external_data_helper import set_external_data

    with open(weights_path, "wb") as blob:
        for tensor in model.graph.initializer:
            data = tensor.raw_data
            if len(data) < INLINE_BYTES:
                continue
            blob.write(b"\0" * (-blob.tell() % ALIGNMENT))
            set_external_data(tensor, WEIGHTS_FILE, blob.tell(), len(data))
            blob.write(data)
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL


# MatMulNBits' accuracy_level 4: activations quantized to int8 per row and block of 32 inside the
# kernel, int8 dot products. Measured on this CPU (docs/export.md): row i of an M-row call is
# bit-identical to that row alone for every M, so SS stays exactly plain decoding; levels 0 and 1
# (fp32 activations) give M = 1 another result than M > 1, and are no faster than fp32 MatMul at M > 1.
ACCURACY_LEVEL = 4


def custom_translations(accuracy_level: int = ACCURACY_LEVEL) -> dict:
    """ONNX for streamfuse's custom ops (export/low_bit.py): ONNX Runtime's MatMulNBits."""
    from onnxscript.values import Opset

    from streamfuse.export import low_bit  # noqa: F401  (registers the ops translated here)

    _register_matmul_nbits()
    matmul_nbits = Opset("com.microsoft", 1).MatMulNBits

    def q4_matmul(x, packed, scales, zero_points, out_features: int):
        return matmul_nbits(x, packed, scales, zero_points, K=packed.shape[1] * 32, N=out_features, bits=4,
                            block_size=32, accuracy_level=accuracy_level)

    def q8_linear(x, codes, scales, out_features: int):
        return matmul_nbits(x, codes, scales, K=codes.shape[1] * 32, N=out_features, bits=8, block_size=32,
                            accuracy_level=accuracy_level)

    return {torch.ops.streamfuse.q4_matmul.default: q4_matmul, torch.ops.streamfuse.q8_linear.default: q8_linear,
            torch.ops.aten.index_copy.default: index_copy}


def index_copy(data, dim: int, index, source):
    """data.index_copy(dim, index, source) as one ScatterND on data's own layout. The exporter's
    default moves `dim` first (a Transpose of the whole cache, ScatterND, a Transpose back): in the
    in-place graphs that is three copies of each layer's cache per call, for T rows written."""
    import onnx
    from onnxscript import opset18 as op

    lead, count = list(data.shape[:dim]), source.shape[dim]
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in lead], np.arange(count), indexing="ij"), axis=-1)[..., :dim]
    lead_index = op.Constant(value=onnx.numpy_helper.from_array(np.ascontiguousarray(grid, dtype=np.int64)))
    slots = op.Expand(op.Reshape(index, op.Constant(value_ints=[1] * dim + [count, 1])),
                      op.Constant(value_ints=lead + [count, 1]))
    return op.ScatterND(data, op.Concat(lead_index, slots, axis=-1), source)


def _register_matmul_nbits() -> None:
    """Teach onnx the schema of ONNX Runtime's MatMulNBits (a contrib op onnx does not know), so the
    exporter can build the node; ONNX Runtime checks it against its own definition at load."""
    from onnx import defs

    if defs.has("MatMulNBits", "com.microsoft"):
        return
    schema = defs.OpSchema
    optional = schema.FormalParameterOption.Optional
    defs.register_schema(schema(
        "MatMulNBits", "com.microsoft", 1,
        inputs=[schema.FormalParameter("A", "T1"), schema.FormalParameter("B", "T2"),
                schema.FormalParameter("scales", "T1"), schema.FormalParameter("zero_points", "T3", param_option=optional)],
        outputs=[schema.FormalParameter("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)"], ""), ("T2", ["tensor(uint8)"], ""),
                          ("T3", ["tensor(uint8)", "tensor(float)"], "")],
        attributes=[schema.Attribute(name, schema.AttrType.INT, "", required=name in ("K", "N", "block_size"))
                    for name in ("K", "N", "bits", "block_size", "accuracy_level")],
    ))
