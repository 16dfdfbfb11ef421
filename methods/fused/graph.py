"""What exporting a fused drafter's pass (ParallelSpec's, Falcon's) as one static graph (ExecuTorch .pte, ONNX)
shares: the writers for each engine, the host's tables beside the graphs (the fp16 token embedding it maps from
disk: the graph does not carry V x H weights for the handful of rows a step reads; the kept token ids), the eager
twin a graph is checked against and the check itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.methods.fused.graph_pass import INPUT_NAMES, open_files  # the runtime owns the contract
from streamfuse.methods.fused.model import FusedDrafter

QUANTIZE = ("none", "int8")
ONNX_FILE, PTE_FILE, EMBEDDING_FILE, VOCAB_FILE = "drafter.onnx", "drafter.pte", "embedding.npy", "vocab.npy"
# max |graph - eager twin| logit over a sequence of passes, relative to the largest |eager| logit (the twin: the fp32
# module, or torchao's int8 one for ExecuTorch's int8 graph): ~1e-6 here
PARITY_TOLERANCE = 1e-4


def write_passes(
    module: nn.Module,
    inputs: tuple,
    output_names: list[str],
    engines: list[str],
    folder: Path,
    quantize: str,
    method: str,
) -> dict[str, str]:
    """A drafter pass module (inputs INPUT_NAMES) for each engine into `folder` -> engine -> file; ExecuTorch's
    with `quantize` weights (`method`.quantize names the setting in an error). quantize "int8": torchao's int8
    weights per output channel with int8 dynamic activations (XNNPACK kernels; a quarter of the bytes a pass
    reads). ONNX Runtime's stays fp32: its dynamic int8 (MatMulInteger) puts the largest logit 0.62 off fp32 on
    SmolLM2's drafter, against torchao's twin-exact module."""
    if quantize not in QUANTIZE:
        raise ValueError(f"{method}.quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    files = {}
    if "onnxruntime" in engines:
        export_onnx(module, inputs, folder, output_names)
        files["onnxruntime"] = ONNX_FILE
    if "executorch" in engines:
        from streamfuse.export.to_executorch import export_pte

        export_pte({"draft": quantized(module, quantize)}, {"draft": inputs}, folder / PTE_FILE)
        files["executorch"] = PTE_FILE
    return files


def quantized(module: nn.Module, quantize: str) -> nn.Module:
    """A copy with torchao's int8 weights ("int8"), or the module itself ("none")."""
    if quantize == "none":
        return module
    from streamfuse.export.to_executorch import quantize_weights

    copy_ = copy.deepcopy(module)
    quantize_weights(copy_, "int8")
    return copy_


def export_onnx(module: nn.Module, inputs: tuple, folder: Path, output_names: list[str]) -> None:
    """A drafter pass (inputs INPUT_NAMES) as folder/ONNX_FILE, its weights in the shared external-data file."""
    import onnx

    from streamfuse.export.onnx_methods import strip_debug_info
    from streamfuse.export.to_onnx import WEIGHTS_FILE, share_weights

    program = torch.export.export(module, inputs, strict=False)
    exported = torch.onnx.export(
        program, (), dynamo=True, input_names=INPUT_NAMES, output_names=output_names, optimize=True, verbose=False
    )
    scratch = folder / "scratch.onnx"
    exported.save(str(scratch), external_data=True)
    model = onnx.load(str(scratch), load_external_data=True)
    strip_debug_info(model)
    share_weights(model, folder / WEIGHTS_FILE)  # the name ONNX records for its external data
    onnx.save_model(model, str(folder / ONNX_FILE))
    for leftover in folder.glob("scratch.onnx*"):
        leftover.unlink()


def write_embedding(embed: nn.Module, folder: Path) -> None:
    """The token embedding table as fp16 .npy: the host maps it and reads the rows a pass needs."""
    np.save(folder / EMBEDDING_FILE, embed.weight.detach().to(torch.float16).cpu().numpy())


def write_tables(drafter: FusedDrafter, embed: nn.Module, folder: Path) -> None:
    """The host's tables beside the graphs: the embedding and the kept token ids."""
    write_embedding(embed, folder)
    np.save(folder / VOCAB_FILE, drafter.vocab_ids.cpu().numpy())


class PassModule(nn.Module):
    """A fused drafter's pass as one module to export: forward(INPUT_NAMES) -> draft(states, embeds, positions,
    read, mask, cache)'s outputs, then the cache's new keys and values (`rows` of them: the rows the pass adds)."""

    def __init__(self, drafter: FusedDrafter, rows: int):
        super().__init__()
        self.drafter, self.rows = drafter, rows

    def forward(self, states, embeds, positions, read, mask, keys, values):
        cache = StepKeyValues(1, self.rows, [(keys, values)])
        outputs = self.draft(states, embeds, positions, read, mask, cache)
        new_keys, new_values = cache.new[0]
        return (*outputs, new_keys, new_values)

    def draft(self, states, embeds, positions, read, mask, cache: StepKeyValues) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


class EagerRunner:
    """A pass module eagerly, behind the graph-runner interface: the reference a graph's parity is checked against."""

    def __init__(self, module: nn.Module):
        self.module = module

    @torch.inference_mode()
    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return [t.numpy() for t in self.module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs))]


def check_graphs(
    method: str,
    folder: Path,
    entry: dict,
    module: nn.Module,
    quantize: str,
    graph_pass: type,
    difference: Callable[[object, object], float],
) -> dict:
    """Each engine's graph in `entry` against the pass module's eager twin (ExecuTorch runs torchao's quantized
    module, which runs eagerly too), both through the runtime's `graph_pass` class (a GraphDrafterPass);
    difference(graph, eager) -> the largest relative difference. -> {engine: difference}; one past
    PARITY_TOLERANCE is refused."""
    embedding = np.load(folder / entry["embedding"], mmap_mode="r")
    vocab_ids = np.load(folder / entry["vocab_file"])

    def opened(runner) -> object:
        return graph_pass(
            runner,
            embedding,
            vocab_ids,
            *(entry[name] for name in graph_pass.ENTRY),
            tuple(entry["cache"]),
            len(embedding),
        )

    parity = {}
    for engine in entry["graphs"]:
        runner = open_files(folder, entry, engine, 1)[0]
        reference = opened(EagerRunner(quantized(module, quantize if engine == "executorch" else "none")))
        error = difference(opened(runner), reference)
        if not error <= PARITY_TOLERANCE:
            raise ValueError(
                f"{method}'s {engine} drafter graph is off its eager twin by {error:.3g} of the largest "
                f"logit > {PARITY_TOLERANCE}: the export is wrong; the artifact keeps no such drafter"
            )
        parity[engine] = float(f"{error:.3g}")
    return parity


@dataclass(frozen=True)
class PassGraph:
    """A fused drafter's pass as a graph: its method's name (its settings' prefix in errors), the pass module's
    output names, the runtime's class that runs the graph (a GraphDrafterPass) and difference(graph, eager,
    hidden, vocab): the largest relative difference of the two over a run of passes (check_graphs)."""

    method: str
    output_names: list[str]
    graph_pass: type
    difference: Callable[[object, object, int, int], float]

    def export(
        self,
        module: nn.Module,
        inputs: tuple,
        fields: dict,
        embed: nn.Module,
        engines: list[str],
        folder: Path,
        quantize: str,
    ) -> dict:
        """The pass module (module.drafter: the drafter) as a graph for each engine, with the host's tables, into
        `folder` (beside its weights), each graph's parity against its eager twin checked (check_graphs). -> its
        manifest entry: `fields` (what graph_pass reads), the files, their formats, the parity."""
        folder, drafter = Path(folder), module.drafter.eval()
        write_tables(drafter, embed, folder)
        files = write_passes(module, inputs, self.output_names, engines, folder, quantize, self.method)
        attention = drafter.layer.self_attn
        entry = {
            **fields,
            "vocab": len(drafter.vocab_ids),
            "cache": [attention.config.num_key_value_heads, attention.head_dim],
            "graphs": files,
            "embedding": EMBEDDING_FILE,
            "vocab_file": VOCAB_FILE,
            "formats": {engine: quantize if engine == "executorch" else "none" for engine in files},
        }
        vocab = embed.weight.shape[0]
        parity = check_graphs(
            self.method,
            folder,
            entry,
            module,
            quantize,
            self.graph_pass,
            lambda graph, eager: self.difference(graph, eager, drafter.hidden_size, vocab),
        )
        return {**entry, "parity": parity}
