"""The export's backends and weight formats: which backend builds which format, which graphs attend with
streamfuse's span kernel, which run here (their parity is checked at export)."""

BACKENDS = ("torch", "executorch", "onnxruntime", "coreml", "executorch_coreml")
# What this machine can verify. Core ML (.mlpackage, fp16: 270 MB for SmolLM2-135M) and the Core ML-delegated
# .pte run only on Apple devices, where their parity is checked: asked for (--backends ...,coreml).
DEFAULT_BACKENDS = ("torch", "executorch", "onnxruntime")
# backend -> (.pte file, ExecuTorch delegate). The Core ML one is built here, run in an app on the device.
PTE_FILES = {"executorch": ("model.pte", "xnnpack"), "executorch_coreml": ("model-coreml.pte", "coreml")}
# Backends whose graphs attend over the cache's used span with streamfuse's exact kernel (graph.GraphShapes.span),
# registered into the engine as a custom op (runtime/ops/tree_attention.py): ExecuTorch on XNNPACK, ONNX Runtime.
SPAN = ("executorch", "onnxruntime")
RUNS_HERE = ("executorch", "onnxruntime")  # the exported backends whose parity is checked here
# What MatMulNBits does with activations in the low-bit ONNX graphs (export/to_onnx.py ACCURACY_LEVEL).
LOW_BIT_ACTIVATIONS = {"activations": "int8 per row and block of 32, quantized in the kernel (as llama.cpp's q8_1)"}
# --quantize value -> the backends that build that format; the others are exported unquantized (the
# manifest's graphs.quantize says which got what). docs/export.md: what each format computes.
FORMATS = {
    "none": BACKENDS,
    "int8": ("executorch", "onnxruntime"),
    "8da4w": ("executorch",),
    "q4-native": ("executorch", "onnxruntime"),
}
# Formats whose graphs take the task's tensors as inputs (export/task_inputs.py): the base's weights are the
# same for every task, so one artifact's graphs serve several tasks. The others merge the LoRA into the weights.
TASK_INPUT_FORMATS = ("q4-native",)
ONNX_LINEARS = ("streamfuse", "matmulnbits")  # ExportConfig.onnx_linear
PTE_LINEARS = ("xnnpack", "streamfuse")  # ExportConfig.pte_linear
