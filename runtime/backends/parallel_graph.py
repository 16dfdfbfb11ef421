"""ParallelSpec's drafter pass on an exported graph (export/parallel_graph.py), a ParallelPass for
runtime/parallel_drafter.py: numpy on the host, no torch for ONNX Runtime.

The cache is the host's [1, kv, C, d] pair; a pass takes R real rows at most, so more pending rows (after
plain steps) go in several passes, the last one's logits kept. Pad rows and unused cache slots are masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from streamfuse.runtime.backends.base import CapacityError
from streamfuse.runtime.backends.sessions import ExecuTorchSession, _require, ort_options
from streamfuse.runtime.onnx_external import check_external_data
from streamfuse.runtime.parallel_drafter import pass_visibility

INPUT_NAMES = ["states", "embeds", "positions", "read", "mask", "keys", "values"]


class OnnxDraftSession:
    """The one-method drafter model through ONNX Runtime, with the target's session options."""

    def __init__(self, model: Path, threads: int | None = None):
        ort = _require("onnxruntime", "onnxruntime")
        check_external_data(Path(model))  # the weights file it names stays in its folder
        self.session = ort.InferenceSession(str(model), ort_options(ort, threads), providers=["CPUExecutionProvider"])

    def run(self, method: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, dict(zip(INPUT_NAMES, inputs)))


def open_files(folder: Path, entry: dict, engine: str, threads: int | None) -> tuple[object, np.ndarray, np.ndarray]:
    """A drafter folder's files as its manifest entry names them -> (the engine's session, the fp16 embedding table
    mapped from disk: the pages a pass reads, not V x H; the kept token ids)."""
    file = Path(folder) / entry["graphs"][engine]
    session = ExecuTorchSession(file, threads) if engine == "executorch" else OnnxDraftSession(file, threads)
    return session, np.load(Path(folder) / entry["embedding"], mmap_mode="r"), np.load(Path(folder) / entry["vocab_file"])


class GraphParallelPass:
    def __init__(self, session, embedding: np.ndarray, vocab_ids: np.ndarray, masks: int, rows: int, capacity: int,
                 cache_shape: tuple[int, int], vocab_size: int):
        self.session, self.embedding, self.vocab_ids = session, embedding, vocab_ids
        self.masks, self.rows, self.capacity, self.vocab_size = masks, rows, capacity, vocab_size
        self.kv_heads, self.head_dim = cache_shape
        self.length = 0
        self.keys = self.values = None

    @classmethod
    def open(cls, folder: Path, entry: dict, engine: str, vocab_size: int, threads: int | None = None) -> "GraphParallelPass":
        """The pass of `engine` in the drafter folder, as its manifest entry records it."""
        session, embedding, vocab_ids = open_files(folder, entry, engine, threads)
        return cls(session, embedding, vocab_ids, entry["masks"], entry["rows"], entry["capacity"],
                   tuple(entry["cache"]), vocab_size)

    def reset(self) -> None:
        shape = (1, self.kv_heads, self.capacity, self.head_dim)
        self.keys, self.values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.length = 0

    def run(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        logits = None
        for start in range(0, len(tokens), self.rows):
            logits = self._pass(states[start : start + self.rows], tokens[start : start + self.rows], position + start)
        return logits

    def _pass(self, states: np.ndarray, tokens: Sequence[int], position: int) -> np.ndarray:
        real, rows, masks = len(tokens), self.rows, self.masks
        if self.length + real > self.capacity:
            raise CapacityError(f"parallelspec's drafter cache is full: {self.length} + {real} rows > {self.capacity} "
                                f"(the build's parallelspec.capacity); lower max_new_tokens or rebuild with a larger one")
        padded = np.zeros((rows, states.shape[1]), np.float32)
        padded[:real] = states
        embeds = np.zeros_like(padded)
        embeds[:real] = self.embedding[np.asarray(tokens)]
        last = position + real - 1
        positions = np.concatenate([np.arange(position, position + real), np.full(rows - real, last),
                                    last + np.arange(1, masks + 1)]).astype(np.int64)
        read = np.concatenate([[real - 1], rows + np.arange(masks)]).astype(np.int64)
        visible = pass_visibility(self.length, self.capacity, real, rows, masks)
        mask = np.where(visible, np.float32(0), np.float32(np.finfo(np.float32).min))
        logits, new_keys, new_values = self.session.run("draft", [padded, embeds, positions, read, mask, self.keys,
                                                                   self.values])
        self.keys[:, :, self.length : self.length + real] = new_keys[:, :, :real]
        self.values[:, :, self.length : self.length + real] = new_values[:, :, :real]
        self.length += real
        return np.array(logits, dtype=np.float32)
