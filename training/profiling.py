"""The build's last stage: decode test inputs with the artifact, SS and plain interleaved, and
profile where the speed-up comes from (runtime/measure/timing.py's interleaved loop, runtime/measure/trace_profile.py's
report). The build runs it in a fresh process, so the peak memory it reports is the runtime's alone."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from streamfuse.runtime.measure.timing import interleaved, summarise
from streamfuse.runtime.measure.trace_profile import profile_files, write_report
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD, DecodeRequest, decode_settings
from streamfuse.runtime.request.inputs import Input
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.trace import Trace


def profile_artifact(
    artifact: Path,
    backend: str,
    sources: list[tuple[str, str]],
    max_new_tokens: int,
    threads: int | None,
    out: Path,
    task: str | None = None,
) -> dict:
    """sources: (id, task source text). Writes traces + profile report under `out`; returns the
    bench summary and the profile metrics (without per-run rows)."""
    if threads:
        torch.set_num_threads(threads)  # the torch backend's; the exported engines take it from load()
    loaded = load(artifact, backend, threads=threads, task=task)
    ss = decode_settings(loaded, DecodeRequest(max_new_tokens=max_new_tokens))  # the default method, its tree
    ar = replace(ss, method=BASELINE_METHOD)
    meta = dict(backend=loaded.backend.name, device="cpu", num_streams=loaded.backend.num_streams, threads=threads)
    traces = {
        DEFAULT_METHOD: Trace(method=ss.method, tree=ss.tree.to_dict(), **meta),
        BASELINE_METHOD: Trace(method=ar.method, tree=None, **meta),
    }
    load_start = os.getloadavg()[0]
    rows = interleaved(loaded, [Input(i, text) for i, text in sources], ss, ar, traces, warmup=1)
    out.mkdir(parents=True, exist_ok=True)
    for name, trace in traces.items():
        trace.save(out / f"trace_{name}.json")
    metrics = profile_files(out / f"trace_{DEFAULT_METHOD}.json", out / f"trace_{BASELINE_METHOD}.json")
    write_report(metrics, out / "profile")
    summary = summarise(rows)
    summary.update(
        backend=loaded.backend.name,
        threads=threads,
        load_average=[load_start, os.getloadavg()[0]],
        mismatched_inputs=[r["id"] for r in rows if not r["same_tokens"]],
    )
    return {"bench": summary, "profile": {k: v for k, v in metrics.items() if k not in ("runs", "meta")}}
