"""What the latency tools share (tools/latency.py, tools/graph_latency.py, tools/draft_latency.py,
tools/pearl_replay.py): the architecture flags, one call timed (CUDA synchronised), one uncommitted step timed, and
the medians' report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from streamfuse.runtime.speculation.tree import TreeSpec


def architecture_parser(description: str) -> argparse.ArgumentParser:
    """The flags both latency tools share: which architecture (random weights) and which trees."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default="smollm2-135m-instruct", help="model name or a folder with config.json")
    parser.add_argument("--gamma", type=int, default=3, help="number of streams")
    parser.add_argument("--msa-layers", type=int, default=8, help="N_s")
    parser.add_argument("--trees", default="gamma=3,k=1;gamma=3,k=2", help="';'-separated tree specs")
    return parser


def timed(backend, call) -> float:
    if backend.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    if backend.device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def step_seconds(backend, tokens: list[int], tree: TreeSpec | None) -> float:
    """One step through the host at the backend's current length (never committed: rolled back)."""
    length = backend.length
    seconds = timed(backend, lambda: backend.step(tokens, tree, with_streams=False))
    backend.rollback(length)
    return seconds


def report_medians(
    samples: dict[str, list[float]], reference: str, keys: tuple[str, str], meta: dict, out: Path | None
) -> list[dict]:
    """Median ms per configuration and its ratio to `reference`'s; printed, and written as JSON to
    `out` if given. keys: the JSON names of the configuration and of the ratio."""
    label, ratio = keys
    base = statistics.median(samples[reference])
    rows = [
        {label: name, "median_ms": 1000 * statistics.median(v), ratio: statistics.median(v) / base}
        for name, v in samples.items()
    ]
    print(json.dumps(meta))
    for row in rows:
        print(f"{row[label]:<70} {row['median_ms']:8.2f} ms  x{row[ratio]:.2f}")
    if out:
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows
