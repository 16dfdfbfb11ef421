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
                                         output_names=output_names[name], optimize=True, verbose=False)
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
