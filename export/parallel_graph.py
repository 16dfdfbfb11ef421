"""ParallelSpec's drafter pass as one static graph (ExecuTorch .pte, ONNX), run by
runtime/backends/parallel_graph.py:

    draft(states [R, H], embeds [R, H], positions [R + k], read [k + 1], mask [R + k, C + R + k],
          keys [1, kv, C, d], values [1, kv, C, d]) -> logits [k + 1, D], new_keys [1, kv, R, d], new_values

R real rows (the pass's accepted nodes, padded), k [MASK] rows, a cache of C slots; the mask is the host's
(runtime/parallel_drafter.py pass_visibility), so the graph needs no cache length; the head runs on the
`read` rows only (the last real row and the masks). The token embeddings come from the host (an fp16 table
it maps from disk: the graph does not carry V x H weights for the handful of rows a step reads).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamfuse.adapters.msa import StepKeyValues
from streamfuse.adapters.parallelspec import ParallelSpecModel
from streamfuse.runtime.backends.parallel_graph import INPUT_NAMES  # the runtime owns the contract

QUANTIZE = ("none", "int8")
OUTPUT_NAMES = ["logits", "new_keys", "new_values"]
ONNX_FILE, PTE_FILE, EMBEDDING_FILE, VOCAB_FILE = "drafter.onnx", "drafter.pte", "embedding.npy", "vocab.npy"


class DraftPass(nn.Module):
    def __init__(self, drafter: ParallelSpecModel, rows: int):
        super().__init__()
        self.drafter, self.rows = drafter, rows

    def forward(self, states, embeds, positions, read, mask, keys, values):
        cache = StepKeyValues(1, self.rows, [(keys, values)])
        inputs = self.drafter.inputs(states[None], embeds[None], self.drafter.num_masks)
        hidden = self.drafter.states(inputs, positions[None], mask[None, None], cache)[0]
        new_keys, new_values = cache.new[0]
        return self.drafter.head(hidden[read]), new_keys, new_values


def example_inputs(drafter: ParallelSpecModel, rows: int, capacity: int) -> tuple[torch.Tensor, ...]:
    attention = drafter.layer.self_attn
    kv_heads = attention.config.num_key_value_heads
    hidden, masks = drafter.head.in_features, drafter.num_masks
    cache = torch.zeros(1, kv_heads, capacity, attention.head_dim)
    return (torch.zeros(rows, hidden), torch.zeros(rows, hidden), torch.arange(rows + masks),
            torch.arange(rows - 1, rows + masks), torch.zeros(rows + masks, capacity + rows + masks), cache, cache.clone())


def export_graphs(drafter: ParallelSpecModel, rows: int, capacity: int, engines: list[str], folder: Path,
                  quantize: str = "none") -> dict[str, str]:
    """Write the pass for each engine into `folder`; returns engine -> file. quantize "int8": ExecuTorch's pass
    gets torchao's int8 weights per output channel with int8 dynamic activations (XNNPACK kernels; a quarter
    of the bytes a pass reads). ONNX Runtime's stays fp32: its dynamic int8 (MatMulInteger) was 0.62 of the
    largest logit off fp32 on SmolLM2's drafter, against torchao's twin-exact module."""
    return write_passes(DraftPass(drafter.eval(), rows), example_inputs(drafter, rows, capacity), OUTPUT_NAMES, engines,
                        folder, quantize, "parallelspec")


def write_passes(module: nn.Module, inputs: tuple, output_names: list[str], engines: list[str], folder: Path,
                 quantize: str, method: str) -> dict[str, str]:
    """A drafter pass module (inputs INPUT_NAMES) for each engine into `folder` -> engine -> file; ExecuTorch's
    with `quantize` weights (`method`.quantize names the setting in an error)."""
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


def quantized(module: DraftPass, quantize: str) -> DraftPass:
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
    exported = torch.onnx.export(program, (), dynamo=True, input_names=INPUT_NAMES, output_names=output_names,
                                 optimize=True, verbose=False)
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


# max |graph - eager twin| logit over a sequence of passes, relative to the largest |eager| logit (the twin: the fp32
# module, or torchao's int8 one for ExecuTorch's int8 graph): ~1e-6 here
PARITY_TOLERANCE = 1e-4


class EagerSession:
    """DraftPass eagerly, behind the session interface: the reference a graph's parity is checked against."""

    def __init__(self, module: DraftPass):
        self.module = module

    @torch.inference_mode()
    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return [t.numpy() for t in self.module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in inputs))]


def graph_entry(drafter: ParallelSpecModel, rows: int, capacity: int, files: dict[str, str]) -> dict:
    """The manifest entry GraphParallelPass.open reads (the caller adds the tree and the training key)."""
    attention = drafter.layer.self_attn
    return {"masks": drafter.num_masks, "rows": rows, "capacity": capacity, "vocab": len(drafter.vocab_ids),
            "cache": [attention.config.num_key_value_heads, attention.head_dim], "graphs": files,
            "embedding": EMBEDDING_FILE, "vocab_file": VOCAB_FILE}


def export_drafter(drafter: ParallelSpecModel, embed: nn.Module, rows: int, capacity: int, engines: list[str],
                   folder: Path, quantize: str = "none") -> dict:
    """The drafter's graphs, embedding table and vocabulary into `folder` (beside its weights), each graph's
    parity against the fp32 eager pass checked; -> its manifest entry. A graph further off than its format's
    PARITY_TOLERANCE is refused."""
    from streamfuse.runtime.backends.parallel_graph import GraphParallelPass, OnnxDraftSession
    from streamfuse.runtime.backends.sessions import ExecuTorchSession

    folder = Path(folder)
    write_embedding(embed, folder)
    np.save(folder / VOCAB_FILE, drafter.vocab_ids.cpu().numpy())
    files = export_graphs(drafter, rows, capacity, engines, folder, quantize)
    entry = {**graph_entry(drafter, rows, capacity, files),
             "formats": {engine: quantize if engine == "executorch" else "none" for engine in files}}
    embedding = np.load(folder / EMBEDDING_FILE, mmap_mode="r")
    vocab = len(embedding)

    def opened(session) -> GraphParallelPass:
        return GraphParallelPass(session, embedding, drafter.vocab_ids.numpy(), drafter.num_masks, rows, capacity,
                                 tuple(entry["cache"]), vocab)

    module = DraftPass(drafter.eval(), rows)
    parity = {}
    for engine, file in files.items():
        session = ExecuTorchSession(folder / file, 1) if engine == "executorch" else OnnxDraftSession(folder / file, 1)
        # ExecuTorch runs torchao's quantized module, which runs eagerly too: the graph's twin
        reference = opened(EagerSession(quantized(module, quantize if engine == "executorch" else "none")))
        error = max_difference(opened(session), reference, drafter.head.in_features, vocab)
        if not error <= PARITY_TOLERANCE:
            raise ValueError(f"parallelspec's {engine} drafter graph is off its eager twin by {error:.3g} of the largest "
                             f"logit > {PARITY_TOLERANCE}: the export is wrong; the artifact keeps no such drafter")
        parity[engine] = float(f"{error:.3g}")
    return {**entry, "parity": parity}


def max_difference(graph, eager, hidden: int, vocab: int, passes: int = 6) -> float:
    """Both passes over the same sequence of 1..rows real rows (random states and tokens): the largest logit
    difference, relative to the largest eager logit."""
    generator = np.random.default_rng(0)
    graph.reset()
    eager.reset()
    worst, position = 0.0, 20
    for index in range(passes):
        real = 1 + index % graph.rows
        states = generator.standard_normal((real, hidden)).astype(np.float32)
        tokens = generator.integers(0, vocab, real).tolist()
        expected = eager.run(states, tokens, position)
        error = np.abs(graph.run(states, tokens, position) - expected).max() / max(np.abs(expected).max(), 1e-6)
        worst = max(worst, float(error))
        position += real
    return worst
