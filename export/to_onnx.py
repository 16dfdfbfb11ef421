"""ONNX: every method in one model (export/onnx_methods.py), its weights in one file beside it.

Attention is streamfuse's exact kernel over the cache's used span (export/span_attention.py), an ONNX Runtime
custom op (domain streamfuse, runtime/kernels/tree_attention_ort.cpp): the graphs take the host's whole
[L, kv, C, d] cache as one input, which ONNX Runtime hands to the ops in place; CommitRows moves the previous
call's accepted rows into place, the attention writes the call's rows after the used span, and no rows come out.
Each method is exported through torch.export (the dynamo exporter) into a scratch folder; the graphs then
become the branches of one model whose initializers are each distinct tensor once, RMSNorm (with its residual
Add) and rotary embedding become one node each and the projections that share an input one product
(export/onnx_passes.py, which read the exporter's value_info, dropped after them), every large initializer
moves into `weights.bin` (page-aligned, so ONNX Runtime maps it rather than reads it), and the embedding's
tables become inputs the host maps from that file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from streamfuse.export.onnx_methods import combine_methods, strip_debug_info
from streamfuse.export.onnx_pack import pack_linears
from streamfuse.export.onnx_passes import (
    drop_unused_initializers,
    fuse_rms_norm,
    fuse_rotary,
    fuse_skip_norm,
    lift_embedding,
)

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 4096  # page-aligned offsets so onnxruntime can map the weights
INLINE_BYTES = 1024  # small tensors stay inside the graph


def export_onnx(
    modules: dict[str, nn.Module],
    inputs: dict[str, tuple],
    input_names: dict[str, list[str]],
    output_names: dict[str, list[str]],
    folder: Path,
) -> tuple[str, str]:
    """Write model.onnx (the methods of `modules`) and weights.bin into `folder`; returns their names."""
    import onnx

    folder = Path(folder)
    models = {}
    with tempfile.TemporaryDirectory(prefix="onnx-", dir=folder) as scratch:
        for name, module in modules.items():
            program = torch.export.export(module, inputs[name], strict=False)
            exported = torch.onnx.export(
                program,
                (),
                dynamo=True,
                input_names=input_names[name],
                output_names=output_names[name],
                optimize=True,
                verbose=False,
                custom_translation_table=custom_translations(),
            )
            exported.save(str(Path(scratch) / f"{name}.onnx"), external_data=True)
            models[name] = onnx.load(str(Path(scratch) / f"{name}.onnx"), load_external_data=True)
            strip_debug_info(models[name], keep_shapes=True)
    model = combine_methods(models)
    fuse_rms_norm(model)
    fuse_skip_norm(model)
    fuse_rotary(model)
    pack_linears(model)
    drop_unused_initializers(model)
    strip_debug_info(model)
    share_weights(model, folder / WEIGHTS_FILE)
    lift_embedding(model)
    onnx.save_model(model, str(folder / MODEL_FILE))
    return MODEL_FILE, WEIGHTS_FILE


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
    """ONNX for streamfuse's custom ops: the low-bit products (export/low_bit.py) as ONNX Runtime's MatMulNBits,
    the attention kernel and the cache's commit (runtime/ops/tree_attention.py) as streamfuse's TreeAttention and
    CommitRows, and streamfuse's own 4-bit linear and Q8_0 head (runtime/ops/q4_linear.py, q8_linear.py) as
    streamfuse.Q4Linear and Q8Linear."""
    from onnxscript.values import Opset

    from streamfuse.export import low_bit  # noqa: F401  (registers the ops translated here)
    from streamfuse.runtime.ops import q4_linear
    from streamfuse.runtime.ops import q8_linear as q8_tiles  # (q8_linear below is MatMulNBits' translation)
    from streamfuse.runtime.ops.tree_attention import ONNX_COMMIT_OP, ONNX_DOMAIN, ONNX_OP, commit_op, torch_op

    _register_schemas()
    own_linear = getattr(Opset(ONNX_DOMAIN, 1), q4_linear.ONNX_OP)
    own_head = getattr(Opset(ONNX_DOMAIN, 1), q8_tiles.ONNX_OP)
    matmul_nbits = Opset("com.microsoft", 1).MatMulNBits
    attention = getattr(Opset(ONNX_DOMAIN, 1), ONNX_OP)
    commit = getattr(Opset(ONNX_DOMAIN, 1), ONNX_COMMIT_OP)

    def q4_matmul(x, packed, scales, zero_points, out_features: int):
        return matmul_nbits(
            x,
            packed,
            scales,
            zero_points,
            K=packed.shape[1] * 32,
            N=out_features,
            bits=4,
            block_size=32,
            accuracy_level=accuracy_level,
        )

    def q8_linear(x, codes, scales, out_features: int):
        return matmul_nbits(
            x,
            codes,
            scales,
            K=codes.shape[1] * 32,
            N=out_features,
            bits=8,
            block_size=32,
            accuracy_level=accuracy_level,
        )

    def tree_attention(query, k_cache, v_cache, layer: int, start, k_extra, v_extra, visible, scale: float, store: int):
        return attention(
            query, k_cache, v_cache, start, k_extra, v_extra, visible, layer=layer, scale=scale, store=store
        )

    def commit_rows(k_cache, v_cache, start, accepted):
        return commit(k_cache, v_cache, start, accepted)

    def linear_q4(x, weights, lora_a, lora_up, rank_splits, out_features: int):
        return own_linear(x, weights, lora_a, lora_up, rank_splits, out_features=out_features)

    def head_q8(x, codes, scales, out_features: int):
        return own_head(x, codes, scales, out_features=out_features)

    return {
        torch.ops.streamfuse.q4_matmul.default: q4_matmul,
        torch.ops.streamfuse.q8_linear.default: q8_linear,
        torch_op(): tree_attention,
        commit_op(): commit_rows,
        q4_linear.torch_op(): linear_q4,
        q8_tiles.torch_op(): head_q8,
    }


def _register_schemas() -> None:
    """Teach onnx the schemas of ONNX Runtime's MatMulNBits (a contrib op onnx does not know) and of
    streamfuse's TreeAttention and CommitRows, so the exporter can build their nodes; ONNX Runtime checks them
    against its own definitions at load."""
    from onnx import defs

    from streamfuse.runtime.ops.q4_linear import ONNX_OP as Q4_OP
    from streamfuse.runtime.ops.q8_linear import ONNX_OP as Q8_OP
    from streamfuse.runtime.ops.tree_attention import ONNX_COMMIT_OP, ONNX_DOMAIN, ONNX_OP

    schema = defs.OpSchema
    types = [("T1", ["tensor(float)"], ""), ("T2", ["tensor(int64)"], "")]
    if not defs.has(ONNX_OP, ONNX_DOMAIN):
        defs.register_schema(
            schema(
                ONNX_OP,
                ONNX_DOMAIN,
                1,
                inputs=[
                    schema.FormalParameter(name, "T2" if name == "start" else "T1")
                    for name in ("query", "k_cache", "v_cache", "start", "k_extra", "v_extra", "visible")
                ],
                outputs=[schema.FormalParameter("out", "T1")],
                type_constraints=types,
                attributes=[
                    schema.Attribute("layer", schema.AttrType.INT, "", required=True),
                    schema.Attribute("scale", schema.AttrType.FLOAT, "", required=True),
                    schema.Attribute("store", schema.AttrType.INT, "", required=True),
                ],
            )
        )
    if not defs.has(ONNX_COMMIT_OP, ONNX_DOMAIN):
        defs.register_schema(
            schema(
                ONNX_COMMIT_OP,
                ONNX_DOMAIN,
                1,
                inputs=[
                    schema.FormalParameter(name, "T1" if name.endswith("cache") else "T2")
                    for name in ("k_cache", "v_cache", "start", "accepted")
                ],
                outputs=[schema.FormalParameter("out", "T2")],
                type_constraints=types,
            )
        )
    if not defs.has(Q4_OP, ONNX_DOMAIN):
        defs.register_schema(
            schema(
                Q4_OP,
                ONNX_DOMAIN,
                1,
                inputs=[
                    schema.FormalParameter(name, {"weights": "T3", "rank_splits": "T2"}.get(name, "T1"))
                    for name in ("x", "weights", "lora_a", "lora_up", "rank_splits")
                ],
                outputs=[schema.FormalParameter("out", "T1")],
                type_constraints=[*types, ("T3", ["tensor(uint8)"], "")],
                attributes=[schema.Attribute("out_features", schema.AttrType.INT, "", required=True)],
            )
        )
    if not defs.has(Q8_OP, ONNX_DOMAIN):
        defs.register_schema(
            schema(
                Q8_OP,
                ONNX_DOMAIN,
                1,
                inputs=[
                    schema.FormalParameter(name, "T4" if name == "codes" else "T1") for name in ("x", "codes", "scales")
                ],
                outputs=[schema.FormalParameter("out", "T1")],
                type_constraints=[*types[:1], ("T4", ["tensor(int8)"], "")],
                attributes=[schema.Attribute("out_features", schema.AttrType.INT, "", required=True)],
            )
        )
    if defs.has("MatMulNBits", "com.microsoft"):
        return
    optional = schema.FormalParameterOption.Optional
    defs.register_schema(
        schema(
            "MatMulNBits",
            "com.microsoft",
            1,
            inputs=[
                schema.FormalParameter("A", "T1"),
                schema.FormalParameter("B", "T2"),
                schema.FormalParameter("scales", "T1"),
                schema.FormalParameter("zero_points", "T3", param_option=optional),
            ],
            outputs=[schema.FormalParameter("Y", "T1")],
            type_constraints=[
                ("T1", ["tensor(float)"], ""),
                ("T2", ["tensor(uint8)"], ""),
                ("T3", ["tensor(uint8)", "tensor(float)"], ""),
            ],
            attributes=[
                schema.Attribute(name, schema.AttrType.INT, "", required=name in ("K", "N", "block_size"))
                for name in ("K", "N", "bits", "block_size", "accuracy_level")
            ],
        )
    )
