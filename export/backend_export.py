"""Each backend's files of an artifact, in its weight format (ArtifactBuilder's part: export/artifact.py): the model
a backend exports (quantized where its format asks), its lowered program, and a task's tensors where the graphs take
them as inputs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from streamfuse.adapters.checkpoint import load_checkpoint
from streamfuse.export import graph
from streamfuse.export.formats import FORMATS, LOW_BIT_ACTIVATIONS, PTE_FILES, SPAN
from streamfuse.export.task_inputs import input_names as task_input_names
from streamfuse.export.task_inputs import save_task_tensors, with_task_inputs
from streamfuse.runtime.artifact.format import TASKS, file_digest


class BackendExports:
    """ArtifactBuilder's backend files: reads its config, checkpoint, staging folder and task."""

    def format(self, backend: str) -> str:
        """The weight format `backend` is exported in: --quantize where the backend offers it."""
        return self.config.quantize if backend in FORMATS[self.config.quantize] else "none"

    def export_model(self, backend: str) -> tuple[torch.nn.Module, dict]:
        """The model `backend` exports, in its weight format, and the format's manifest record."""
        from streamfuse.export.span_attention import span_model
        from streamfuse.export.xnnpack_graph import xnnpack_model

        fmt = self.format(backend)
        if backend == "executorch":  # XNNPACK: a copy with partition-friendly modules, maybe quantized
            if fmt == "q4-native":  # the GGUF's codes in the closest form XNNPACK holds (bf16 scales)
                from streamfuse.export.xnnpack_low_bit import use_xnnpack_codes

                model, details = self._q4_native_model()
                model = xnnpack_model(model)
                if self.config.pte_linear == "streamfuse":  # every linear and the head on streamfuse's ops
                    from streamfuse.export.q4_kernel import use_kernel_linears

                    return model, {**details, **use_kernel_linears(model, head=True), **LOW_BIT_ACTIVATIONS}
                return model, {**details, **use_xnnpack_codes(model), "activations": "int8 per token (dynamic)"}
            from streamfuse.export.to_executorch import quantize_weights

            model = xnnpack_model(self.model_and_tokenizer()[0])
            quantize_weights(model, fmt)
            return model, {"name": fmt, **({} if fmt == "none" else {"activations": "int8 per token (dynamic)"})}
        if backend != "onnxruntime":
            return self.model_and_tokenizer()[0], {"name": fmt}
        # ONNX: the exact kernel's attention, as on ExecuTorch (SS == plain decoding exactly)
        if fmt == "q4-native":  # LoRA unmerged beside the GGUF's own codes
            model, details = self._q4_native_model()
            if self.config.onnx_linear == "streamfuse":
                from streamfuse.export.q4_kernel import use_kernel_linears

                details = {**details, **use_kernel_linears(model, head=True)}
            return span_model(model), {**details, **LOW_BIT_ACTIVATIONS}
        model = span_model(self.model_and_tokenizer()[0])
        if fmt == "int8":
            from streamfuse.export.low_bit import quantize_int8

            return model, {"name": fmt, **quantize_int8(model), **LOW_BIT_ACTIVATIONS}
        return model, {"name": fmt}

    def _q4_native_model(self) -> tuple[torch.nn.Module, dict]:
        """The checkpoint (LoRA unmerged) on the base GGUF's own codes, and the format's details."""
        from streamfuse.adapters.base_model import base_gguf
        from streamfuse.adapters.gguf_codes import read_base_codes
        from streamfuse.export.low_bit import use_base_codes

        model, _, checkpoint = load_checkpoint(self.checkpoint)
        self._keep_head(model)
        parts = model.requires_grad_(False).parts
        codes = read_base_codes(base_gguf(checkpoint["base_model"]), parts.num_heads, parts.num_kv_heads)
        return model, {"name": "q4-native", **use_base_codes(model, codes)}

    def _export(self, backend: str) -> dict:
        model, fmt = self.export_model(backend)
        if fmt["name"] != self.config.quantize:
            print(
                f"[export] {backend}: --quantize {self.config.quantize} is not built for {backend}; exporting it "
                f"unquantized",
                flush=True,
            )
        shapes = self.shapes(span=backend in SPAN)
        modules = self.modules(model, span=shapes.span)
        inputs = graph.example_inputs(model, shapes)
        input_names, output_names = graph.names_of(modules, shapes)
        task_inputs = self.config.task_inputs
        if task_inputs:  # the trained tensors become inputs: the graphs hold the base alone
            modules, inputs = with_task_inputs(modules, inputs, model)
            input_names = {method: [*names, *task_input_names(model)] for method, names in input_names.items()}
            fmt = {**fmt, "task_inputs": len(task_input_names(model))}
        if backend in PTE_FILES:
            from streamfuse.export.to_executorch import export_pte

            name, delegate = PTE_FILES[backend]
            target = self.staging / name
            export_pte(modules, inputs, target.with_suffix(".tmp"), delegate, dynamic_linears=task_inputs)
            target.with_suffix(".tmp").replace(target)
            return {"files": {"program": self._entry(target)}, "format": fmt}
        if backend == "onnxruntime":
            from streamfuse.export.to_onnx import export_onnx

            folder = self.staging / "onnx"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            model, weights = export_onnx(modules, inputs, input_names, output_names, folder)
            files = {"model": self._entry(folder / model), "weights": self._entry(folder / weights)}
            return {"files": files, "format": fmt}
        from streamfuse.export.to_coreml import export_mlpackage, spec_signature

        target = self.staging / "model.mlpackage"
        export_mlpackage(modules, inputs, input_names, output_names, target, self.config.coreml_precision)
        return {"files": {"package": self._entry(target)}, "spec": spec_signature(target), "format": fmt}

    def _task_file(self, backend: str) -> dict:
        """The task's tensors for `backend`'s graphs (export/task_inputs.py), from the model it exports."""
        model, _ = self.export_model(backend)
        target = self.task_folder / f"{backend}.safetensors"
        target.parent.mkdir(parents=True, exist_ok=True)
        save_task_tensors(model, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)
        return {"file": {"path": f"{TASKS}/{self.task}/{target.name}", **file_digest(target)}}

    def graph_file(self, entry: dict) -> Path:
        """A backend's file (a manifest entry) as this build reads it: staged, or the artifact's a task joins."""
        return (self.graphs_in or self.staging) / entry["path"]


def tensors_stage(backend: str, key: str) -> str:
    """A task's tensor file: it depends on the trained weights, which the staging folder's key may leave out."""
    return f"tensors-{backend}-{key}"
