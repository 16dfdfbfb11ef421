"""What the benchmark runs: every backend and peer loaded up front, each labelled with its precision
and the resident memory its loading added (all models share one process, so the process peak says
little per row)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from streamfuse.export.eager import TorchBackend
from streamfuse.runtime.artifact.format import MANIFEST
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD, DecodeRequest, decode_settings
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.loader import Loaded, artifact_tasks, load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.tools.bench_data import BenchInput
from streamfuse.tools.bench_matrix import Engine, current_rss
from streamfuse.tools.peer_registry import PEERS, build_peers
from streamfuse.tools.peers_gguf import QUANTS
from streamfuse.tools.peers_runners import PeerContext


def backend_precision(artifact: Path, backend: str) -> str:
    """fp32 unless the artifact's manifest records quantized weights for the backend or a Core ML precision."""
    manifest = artifact / MANIFEST
    graphs = json.loads(manifest.read_text()).get("graphs", {}) if manifest.is_file() else {}
    quantized = graphs.get("quantize", {}).get(backend, "none")
    if backend != "coreml" and quantized != "none":
        return quantized
    if backend == "coreml":
        return {"float16": "fp16", "float32": "fp32"}.get(graphs.get("coreml_precision"), "fp16")
    return "fp32"


def peer_precision(name: str) -> str:
    """The weights a peer runs: its GGUF type, optimum's 8da4w, or fp32 (hf* peers run the fp32 torch model)."""
    quant = next((q for q in (*QUANTS, "8da4w") if f"_{q}" in name), "f32")
    return "fp32" if quant == "f32" else quant


def load_engines(args: argparse.Namespace, info: dict) -> dict[str, Engine]:
    """Every backend loaded up front, with its settings and traces. Each one's memory is recorded
    after one short warm-up run of every method: engines may open their graphs on first use."""
    out = {}
    for entry in args.backends:
        backend, _, folder = entry.partition("@")  # BACKEND@FOLDER: another artifact's backend
        artifact = Path(folder) if folder else args.artifact
        before = current_rss()
        task = args.task if args.task in artifact_tasks(artifact) else None  # an artifact with several: the task's
        loaded = load(artifact, backend, args.device, args.stream_schedule, args.threads, task=task)
        request = DecodeRequest(
            DEFAULT_METHOD,
            args.max_new_tokens,
            tree=args.tree,
            fallback=args.fallback == "auto",
            prune_threshold=args.prune_threshold,
            prune_budget=args.prune_budget,
        )
        ss = decode_settings(loaded, request)
        meta = dict(
            backend=loaded.backend.name,
            device=args.device,
            num_streams=loaded.backend.num_streams,
            threads=args.threads,
        )
        settings = {label: method_settings(label, loaded, ss) for label in args.methods}
        trees = {label: each.tree for label, each in settings.items()}
        warm_up(loaded, settings.values())
        info[entry] = {
            "precision": backend_precision(artifact, backend),
            "model": "fine-tuned",
            "load_rss_bytes": current_rss() - before,
            "artifact": str(artifact),
        }
        if isinstance(loaded.backend, TorchBackend):
            info[entry]["kernels"] = loaded.backend.kernels  # packed or eager linear layers
        traces = {
            m: Trace(
                method=m,
                tree=trees[m].to_dict() if registry.get(settings[m].method).speculative else None,
                fallback_step_cost=settings[m].fallback.step_cost if settings[m].fallback else None,
                **meta,
            )
            for m in args.methods
        }
        out[entry] = Engine(loaded, settings, traces)
    return out


def method_settings(label: str, loaded: Loaded, ss: DecodeSettings) -> DecodeSettings:
    """A --methods entry: METHOD, or METHOD:VALUE for a variant in the same interleaved run, sd:G (its
    chain of G drafts) or specdec++:H (its stop threshold). --tree and pruning are the default method's; plain
    decoding carries its tree along, unused, for the report."""
    name, _, value = label.partition(":")
    if name == BASELINE_METHOD:
        return replace(ss, method=name, prune=None, fallback=None)
    if name == ss.method:
        return ss
    request = DecodeRequest(name, ss.rules.max_new_tokens, fallback=ss.fallback is not None)
    settings = decode_settings(loaded, request)
    if value:
        settings = replace(settings, **registry.get(name).variant(value))
        loaded.check_method_tree(name, settings.tree)
    return settings


def warm_up(loaded: Loaded, settings) -> None:
    """Two tokens of each method: every graph and draft model a benchmark calls runs once (and loads)."""
    ids = prompt_ids(loaded, "Hello.", loaded.prompt is not None)
    model = Model(loaded)
    for each in settings:
        model.run(ids, settings=replace(each, rules=StopRules(2, each.rules.stop_token_ids)))


def load_peers(args: argparse.Namespace, loaded: Loaded, inputs: list[BenchInput], info: dict) -> tuple[dict, dict]:
    """-> (runners, {name: reason skipped}); each built alone so its load RSS can be recorded."""
    longest = max(len(prompt_ids(loaded, item.text, True)) for item in inputs)
    context = PeerContext(loaded, args.artifact, args.threads, 0)
    context.n_ctx = args.n_ctx or -(-(longest + args.max_new_tokens + context.pld_tokens + 1) // 256) * 256
    runners, skipped = {}, {}
    for name in args.peers:
        before = current_rss()
        built, reasons = build_peers([name], context)
        runners.update(built)
        skipped.update(reasons)
        info[name] = {
            "precision": peer_precision(name),
            "load_rss_bytes": current_rss() - before,
            "model": "fine-tuned" if PEERS[name].same_model else "base (not fine-tuned)",
        }
    for name, reason in skipped.items():
        print(f"[bench] skipping peer {name}: {reason}", file=sys.stderr)
    return runners, skipped
