"""Core ML: one multifunction .mlpackage (prefill, decode, step, streams) for the Neural Engine.

Converted here from torch.export programs to an ML program (iOS 17 / macOS 14, fp16 compute by
default, which is what the Neural Engine runs); identical weights of the four functions are
stored once by coremltools' multifunction merge. Running it needs macOS: on Linux the package
is built and its spec checked, never executed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse import seams

DEFAULT_FUNCTION = "decode"  # every artifact has it


SCRATCH_PREFIX = "coreml-"  # one package per method, beside the target, merged into it at the end


def export_mlpackage(
    modules: dict[str, nn.Module],
    inputs: dict[str, tuple],
    input_names: dict[str, list[str]],
    output_names: dict[str, list[str]],
    path: Path,
    precision: str = "float16",
) -> None:
    import coremltools as ct

    seams.register_coreml_alias()
    compute = {"float16": ct.precision.FLOAT16, "float32": ct.precision.FLOAT32}[precision]
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=Path(path).parent) as scratch:
        descriptor = ct.utils.MultiFunctionDescriptor()
        for name, module in modules.items():
            program = torch.export.export(module, inputs[name], strict=False).run_decompositions({})
            types = [
                ct.TensorType(name=n, shape=t.shape, dtype=np.int32 if t.dtype == torch.long else np.float32)
                for n, t in zip(input_names[name], inputs[name])
            ]
            model = ct.convert(
                program,
                inputs=types,
                outputs=[ct.TensorType(name=n) for n in output_names[name]],
                convert_to="mlprogram",
                minimum_deployment_target=ct.target.iOS17,
                compute_precision=compute,
            )
            single = Path(scratch) / f"{name}.mlpackage"
            model.save(str(single))
            descriptor.add_function(str(single), src_function_name="main", target_function_name=name)
        descriptor.default_function_name = DEFAULT_FUNCTION
        shutil.rmtree(path, ignore_errors=True)
        ct.utils.save_multifunction(descriptor, str(path))


def spec_signature(path: Path) -> dict[str, dict]:
    """function -> {"inputs": [(name, shape, dtype)], "outputs": [name]} read from the saved package."""
    import coremltools as ct

    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    result = {}
    for function in spec.description.functions:
        result[function.name] = {
            "inputs": [
                (i.name, list(i.type.multiArrayType.shape), _dtype_name(i.type.multiArrayType.dataType))
                for i in function.input
            ],
            "outputs": [o.name for o in function.output],
        }
    return result


def _dtype_name(code: int) -> str:
    from coremltools.proto import FeatureTypes_pb2

    return FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(code).lower()
