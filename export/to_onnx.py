"""ONNX: one graph per method (ONNX has one entry point per model), weights stored once.

Each method is exported through torch.export (the dynamo exporter) into a scratch folder; then
every initializer is moved into one shared `weights.bin`, deduplicated by content, so the four
graphs reference the same bytes: the artifact carries one copy of the model, not four.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import torch
from torch import nn

WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 4096  # page-aligned offsets so onnxruntime can map the weights
INLINE_BYTES = 1024  # small tensors stay inside the graph


def export_onnx(modules: dict[str, nn.Module], inputs: dict[str, tuple], input_names: dict[str, list[str]],
                output_names: dict[str, list[str]], folder: Path) -> dict[str, str]:
    """Write <method>.onnx for each method plus weights.bin into `folder`; returns method -> file name."""
    import onnx

    folder = Path(folder)
    with tempfile.TemporaryDirectory(prefix="onnx-", dir=folder) as scratch:
        models = {}
        for name, module in modules.items():
            program = torch.export.export(module, inputs[name], strict=False)
            exported = torch.onnx.export(program, (), dynamo=True, input_names=input_names[name],
                                         output_names=output_names[name], optimize=True, verbose=False,
                                         custom_translation_table=custom_translations())
            exported.save(str(Path(scratch) / f"{name}.onnx"), external_data=True)
            models[name] = onnx.load(str(Path(scratch) / f"{name}.onnx"), load_external_data=True)
        share_weights(models, folder / WEIGHTS_FILE)
    files = {}
    for name, model in models.items():
        files[name] = f"{name}.onnx"
        onnx.save_model(model, str(folder / files[name]))
    return files


def share_weights(models: dict, weights_path: Path) -> None:
    """Move large initializers of all models into one file, each distinct tensor once."""
    from onnx import TensorProto
    from onnx.external_data_helper import set_external_data

    offsets: dict[str, tuple[int, int]] = {}
    with open(weights_path, "wb") as blob:
        for model in models.values():
            for tensor in model.graph.initializer:
                data = tensor.raw_data
                if len(data) < INLINE_BYTES:
                    continue
                digest = hashlib.sha256(data).hexdigest()
                if digest not in offsets:
                    blob.write(b"\0" * (-blob.tell() % ALIGNMENT))
                    offsets[digest] = (blob.tell(), len(data))
                    blob.write(data)
                offset, length = offsets[digest]
                set_external_data(tensor, WEIGHTS_FILE, offset, length)
                tensor.ClearField("raw_data")
                tensor.data_location = TensorProto.EXTERNAL


# MatMulNBits' accuracy_level 4: activations quantized to int8 per row and block of 32 inside the
# kernel, int8 dot products. Measured on this CPU (docs/export.md): row i of an M-row call is
# bit-identical to that row alone for every M, so SS stays exactly plain decoding; levels 0 and 1
# (fp32 activations) give M = 1 another result than M > 1, and are no faster than fp32 MatMul at M > 1.
ACCURACY_LEVEL = 4


def custom_translations(accuracy_level: int = ACCURACY_LEVEL) -> dict:
    """ONNX for streamfuse's custom ops (export/low_bit.py): ONNX Runtime's MatMulNBits."""
    from onnxscript import opset18 as op
    from onnxscript.values import Opset

    _register_matmul_nbits()
    matmul_nbits = Opset("com.microsoft", 1).MatMulNBits

    def q4_linear(x, packed, scales, zero_points, mins_t, out_features: int):
        groups = mins_t.shape[0]
        scaled = matmul_nbits(x, packed, scales, zero_points, K=groups * 32, N=out_features, bits=4, block_size=32,
                              accuracy_level=accuracy_level)
        blocks = op.Reshape(x, op.Constant(value_ints=[0, 0, groups, 32]))
        sums = op.ReduceSum(blocks, op.Constant(value_ints=[-1]), keepdims=0)
        return op.Add(scaled, op.MatMul(sums, mins_t))

    def q8_linear(x, codes, scales, out_features: int):
        return matmul_nbits(x, codes, scales, K=codes.shape[1] * 32, N=out_features, bits=8, block_size=32,
                            accuracy_level=accuracy_level)

    return {torch.ops.streamfuse.q4_linear.default: q4_linear, torch.ops.streamfuse.q8_linear.default: q8_linear}


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
