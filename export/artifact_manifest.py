"""The manifest an artifact's build writes (ArtifactBuilder's part: export/artifact.py; the format:
runtime/artifact/format.py): the model, its streams and trees, the graphs and their formats, the cache layout, the files
and their digests, the parity, the versions that made it."""

from __future__ import annotations

from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from streamfuse.adapters.checkpoint import read_manifest, weights_digest
from streamfuse.export import graph
from streamfuse.export.formats import SPAN
from streamfuse.runtime.artifact.contract import ENGINE_CACHE, HOST_CACHE
from streamfuse.runtime.artifact.files import folder_files
from streamfuse.runtime.artifact.format import DRAFT_VOCAB, HEAD_VOCAB, SCHEMA, TASKS, file_digest

VERSIONED = (
    "torch",
    "transformers",
    "peft",
    "executorch",
    "torchao",
    "onnx",
    "onnxscript",
    "onnxruntime",
    "coremltools",
    "streamfuse",
)


def versions() -> dict[str, str]:
    found = {}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


class ManifestRecord:
    """ArtifactBuilder's manifest: reads its model, checkpoint, config and staging folder."""

    def adapter_entry(self, root: Path, path: str) -> dict:
        """The manifest's record of the checkpoint copied to root / `path` (`path` relative to the artifact)."""
        trained = read_manifest(self.checkpoint)
        return {
            "path": path,
            "lora": trained["lora"],
            "training_key": trained["info"].get("training_key"),
            "weights_sha256": weights_digest(self.checkpoint),
            **file_digest(root / path),
        }

    def _manifest(
        self, files: dict, parity: dict, seconds: dict, formats: dict, task_files: dict, lending: dict | None
    ) -> dict:
        model, tokenizer, checkpoint = self.model_and_tokenizer()
        # "methods" describes the graphs this runtime runs: the span graphs where any were built (Core ML's
        # package records its own signature, "spec").
        parts, shapes = model.parts, self.shapes(span=any(backend in SPAN for backend in files))
        modules = self.modules(model, span=shapes.span)
        return {
            "schema": SCHEMA,
            "build_key": self.key,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "task": checkpoint["info"].get("task"),
            "prompt": checkpoint["info"].get("prompt"),
            "model": {
                "base_model": checkpoint["base_model"],
                "num_layers": parts.num_layers,
                "hidden_size": parts.hidden_size,
                "num_kv_heads": parts.num_kv_heads,
                "head_dim": parts.head_dim,
                "vocab_size": parts.vocab_size,
                "max_positions": parts.max_positions,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "head_vocab": None
                if self.head is None
                else {"path": HEAD_VOCAB, **self.head.to_dict(), **file_digest(self.staging / HEAD_VOCAB)},
            },
            "streams": checkpoint["streams"],
            "trees": [tree.to_dict() for tree in self.trees],
            "calibration": {"acceptance": None, "backends": {}},
            "graphs": {
                "key": self.graph_key,
                "capacity": shapes.capacity,
                "prefill_chunk": shapes.prefill_chunk,
                "buckets": list(shapes.buckets),
                "batches": [list(pair) for pair in shapes.batches] if shapes.span else [],
                "dtype": "float32",
                "stream_schedule": "deferred",
                "quantize": {b: f["name"] for b, f in formats.items()},
                "formats": formats,
                "coreml_precision": self.config.coreml_precision,
                "greedy_step": {
                    "schedules": self.greedy_schedules(),
                    "width": shapes.width,
                    "draft_vocab": None
                    if self.draft is None
                    else {"path": DRAFT_VOCAB, **self.draft.to_dict(), **file_digest(self.staging / DRAFT_VOCAB)},
                },
                "heads": {"count": self.num_heads, "training_key": self.heads_key},
                "methods": graph.signature(modules, graph.example_inputs(model, shapes), shapes),
            },
            "kv_layout": {
                "axes": ["layer", "kv_head", "position", "head_dim"],
                "shape": [parts.num_layers, parts.num_kv_heads, shapes.capacity, parts.head_dim],
                "capacity": shapes.capacity,
                "dtype": "float32",
                # who writes the cache (runtime/backends/static_graph.py): the engine (the span graphs)
                # or the host, per backend
                "owner": {backend: ENGINE_CACHE if backend in SPAN else HOST_CACHE for backend in files},
            },
            "tokenizer": {
                "path": "tokenizer",
                "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id,
                "files": folder_digests(self.staging / "tokenizer"),
            },
            "adapter": self.adapter_entry(self.staging, "adapter"),
            "task_files": task_files,  # backend -> this task's tensors, where its graphs take them as inputs
            # other tasks on these graphs (runtime/artifact/format.py TASK_FIELDS each), kept while the graphs are the
            # same
            TASKS: {} if lending is None else lending[TASKS],
            "drafters": {},  # other methods' drafters, added by install_drafter (their own build stages)
            "files": files,
            "export_seconds": seconds,
            "parity": parity,
            "info": self.info,
            "profile": None,
            "versions": versions(),
        }


def folder_digests(folder: Path) -> dict[str, dict]:
    """Each file of a folder by its relative name: bytes + sha256 (the tokenizer's: each changes behaviour)."""
    return {file.relative_to(folder).as_posix(): file_digest(file) for file in folder_files(folder)}
