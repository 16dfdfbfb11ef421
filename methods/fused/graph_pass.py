"""A fused drafter's pass on an exported graph (methods/fused/graph.py writes it): numpy on the host, no torch for
ONNX Runtime. The graph's contract is here: one method, "draft", of inputs INPUT_NAMES.

The cache is the host's [1, kv, C, d] pair, C slots; a call takes R rows (real rows, then pad rows), each row's
view of the cache and the call's rows a mask (the method's visibility). Pad rows and unseen slots are masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from streamfuse.runtime.artifact.onnx_external import check_external_data
from streamfuse.runtime.backends.runners import ExecuTorchRunner, _require, ort_options

INPUT_NAMES = ["states", "embeds", "positions", "read", "mask", "keys", "values"]


class OnnxDraftRunner:
    """The one-method drafter model through ONNX Runtime, with the target's session options."""

    def __init__(self, model: Path, threads: int | None = None):
        ort = _require("onnxruntime", "onnxruntime")
        check_external_data(Path(model))  # the weights file it names stays in its folder
        self.session = ort.InferenceSession(str(model), ort_options(ort, threads), providers=["CPUExecutionProvider"])

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, dict(zip(INPUT_NAMES, inputs)))


def open_files(folder: Path, entry: dict, engine: str, threads: int | None) -> tuple[object, np.ndarray, np.ndarray]:
    """A drafter folder's files as its manifest entry names them -> (the engine's graph runner, the fp16 embedding table
    mapped from disk: the pages a pass reads, not V x H; the kept token ids)."""
    file = Path(folder) / entry["graphs"][engine]
    runner = ExecuTorchRunner(file, threads) if engine == "executorch" else OnnxDraftRunner(file, threads)
    embedding = np.load(Path(folder) / entry["embedding"], mmap_mode="r")
    return runner, embedding, np.load(Path(folder) / entry["vocab_file"])


class GraphDrafterPass:
    """The host side a method's graph pass shares: the graph runner, the tables, the cache and the call's inputs."""

    ENTRY: tuple[str, ...]  # the manifest entry's fields its constructor takes after the tables, the cache's shape last

    def __init__(
        self,
        runner,
        embedding: np.ndarray,
        vocab_ids: np.ndarray,
        rows: int,
        slots: int,
        cache_shape: tuple[int, int],
        vocab_size: int,
    ):
        self.runner, self.embedding, self.vocab_ids = runner, embedding, vocab_ids
        self.rows, self.slots, self.vocab_size = rows, slots, vocab_size
        self.kv_heads, self.head_dim = cache_shape
        self.keys = self.values = None

    @classmethod
    def open(cls, folder: Path, entry: dict, engine: str, vocab_size: int, threads: int | None = None):
        """The pass of `engine` in the drafter folder, as its manifest entry records it."""
        runner, embedding, vocab_ids = open_files(folder, entry, engine, threads)
        return cls(
            runner, embedding, vocab_ids, *(entry[name] for name in cls.ENTRY), tuple(entry["cache"]), vocab_size
        )

    def reset(self) -> None:
        shape = (1, self.kv_heads, self.slots, self.head_dim)
        self.keys, self.values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def rows_in(self, states: np.ndarray, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """A call's states and token embeddings [R, H]: the real rows, then zero pad rows."""
        padded = np.zeros((self.rows, states.shape[1]), np.float32)
        padded[: len(tokens)] = states
        embeds = np.zeros_like(padded)
        embeds[: len(tokens)] = self.embedding[np.asarray(tokens)]
        return padded, embeds

    def call(self, inputs: list[np.ndarray], visible: np.ndarray, slot: int, real: int) -> list[np.ndarray]:
        """Run the graph on (states, embeds, positions, read) + the mask of `visible`; the real rows' K/V go to
        cache slots slot..; -> the outputs before the K/V."""
        mask = np.where(visible, np.float32(0), np.float32(np.finfo(np.float32).min))
        *outputs, new_keys, new_values = self.runner.run("draft", [*inputs, mask, self.keys, self.values])
        self.keys[:, :, slot : slot + real] = new_keys[:, :, :real]
        self.values[:, :, slot : slot + real] = new_values[:, :, :real]
        return [np.array(output, dtype=np.float32) for output in outputs]
