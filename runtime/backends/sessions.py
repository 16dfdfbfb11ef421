"""Sessions: run one exported method on one engine. Each imports its engine only when used, so
a missing optional package is a clear error naming the extra to install."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from streamfuse.runtime.backends.static_graph import CACHE_INPUTS, INPUT_NAMES, METHODS, Session, layer_input


class MissingBackend(RuntimeError):
    pass


def _require(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingBackend(f"{module} is not installed ({error.msg}); install it with "
                             f"`pip install 'streamfuse[{extra}]'`") from None


class ExecuTorchSession:
    """The .pte through ExecuTorch's Python runtime (XNNPACK kernels on CPU)."""

    def __init__(self, pte: Path, threads: int | None = None):
        runtime = _require("executorch.runtime", "executorch")
        from executorch.extension.pybindings import portable_lib

        # XNNPACK sizes its own pool from the CPU count; set it so --threads means the same on every backend.
        portable_lib._unsafe_reset_threadpool(threads or torch.get_num_threads())
        program = runtime.Runtime.get().load_program(Path(pte))
        self.methods = {name: program.load_method(name) for name in program.method_names}
        self.name = "executorch:xnnpack"

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.methods[method].execute(inputs))


PROVIDER_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider",
                       "CPUExecutionProvider")


class OnnxRuntimeSession:
    """One InferenceSession per method, opened on the method's first call: each session holds its
    own prepacked copy of the weights, and a run uses two or three of the five methods (plain
    decoding: prefill + decode; greedy SS: prefill + greedy_step). The provider is the best
    available one, named in the trace."""

    def __init__(self, graphs: dict[str, Path], provider: str | None = None, threads: int | None = None):
        ort = _require("onnxruntime", "onnx")
        available = ort.get_available_providers()
        if provider is not None and provider not in available:
            raise MissingBackend(f"onnxruntime provider {provider} is not available here (available: "
                                 f"{', '.join(available)}); GPU providers need the onnxruntime-gpu package")
        provider = provider or next(p for p in PROVIDER_PREFERENCE if p in available)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        # No spin-waiting between calls (as OMP_WAIT_POLICY=PASSIVE for torch): spinning threads
        # steal the cores from whatever runs next, which distorts every other timing on a small CPU.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        missing = [str(path) for path in graphs.values() if not Path(path).is_file()]
        if missing:
            raise FileNotFoundError(f"ONNX graphs missing: {', '.join(missing)}; copy the artifact again or rebuild it")
        self._open = lambda path: ort.InferenceSession(str(path), options, providers=[provider])
        self.graphs = dict(graphs)
        self.sessions: dict[str, object] = {}
        self.spans: dict[str, bool] = {}  # method -> its graph takes the cache rows up to the call's own
        self.name = f"onnxruntime:{provider}"

    def session(self, method: str):
        """The method's InferenceSession, opened now if this is its first call."""
        if method not in self.sessions:
            self.sessions[method] = self._open(self.graphs[method])
            cache = {i.name: i.shape for i in self.sessions[method].get_inputs()}[layer_input(CACHE_INPUTS[0], 0)]
            self.spans[method] = not isinstance(cache[2], int)  # a named dim: the graph takes rows up to its own
        return self.sessions[method]

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        session = self.session(method)
        return [torch.from_numpy(out) for out in session.run(None, self._feed(method, inputs))]

    def _feed(self, method: str, inputs: list[torch.Tensor]) -> dict:
        """Inputs by graph name. The cache goes in per layer, as views of the host's tensors (no copy),
        cut to the rows up to the call's own where the graph takes that (to_onnx.DYNAMIC_SPAN)."""
        named = dict(zip(INPUT_NAMES[method], inputs))
        rows = int(named["cache_len"][0]) + named["ids"].shape[1] if self.spans[method] else None
        feed = {}
        for name, tensor in named.items():
            if name in CACHE_INPUTS:
                feed.update({layer_input(name, layer): tensor[layer : layer + 1, :, :rows].numpy()
                             for layer in range(tensor.shape[0])})
            else:
                feed[name] = tensor.numpy()
        return feed


class CoreMLSession:
    """The multifunction .mlpackage on the Neural Engine (macOS only); functions by the package's names."""

    def __init__(self, package: Path, compute_units: str = "ALL"):
        if platform.system() != "Darwin":
            raise MissingBackend(f"Core ML models run on macOS only (this is {platform.system()}); copy the artifact "
                                 f"to a Mac, or use --backend executorch / onnxruntime here")
        ct = _require("coremltools", "coreml")
        units = getattr(ct.ComputeUnit, compute_units)
        spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
        functions = [f.name for f in spec.description.functions if f.name in METHODS]  # older packages have fewer
        self.models = {name: ct.models.MLModel(str(package), function_name=name, compute_units=units)
                       for name in functions}
        self.inputs = {name: [i.name for i in m.get_spec().description.input] for name, m in self.models.items()}
        self.outputs = {name: [o.name for o in m.get_spec().description.output] for name, m in self.models.items()}
        self.name = f"coreml:{compute_units.lower()}"

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        feed = {name: (t.int() if t.dtype == torch.long else t).numpy() for name, t in zip(self.inputs[method], inputs)}
        result = self.models[method].predict(feed)
        outputs = [torch.from_numpy(result[name]) for name in self.outputs[method]]
        # fp16 compute returns fp16 arrays; token ids (greedy_step) come back as int32
        return [t.long() if not t.dtype.is_floating_point else t.float() for t in outputs]


def open_session(files_key: str, files: dict[str, Path], threads: int | None = None) -> Session:
    """The session for one backend's checked files (artifact manifest key -> engine)."""
    if files_key == "executorch":
        return ExecuTorchSession(files["program"], threads)
    if files_key == "onnx":
        return OnnxRuntimeSession({name: path for name, path in files.items() if name != "weights"}, threads=threads)
    if files_key == "coreml":
        return CoreMLSession(files["package"])
    raise ValueError(f"no runtime session for {files_key!r} files (built for a device, not for this runtime)")
