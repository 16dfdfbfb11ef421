"""The benchmark loop: every input through every backend's methods and every peer, interleaved.

Per input, the units (one per streamfuse backend, one per peer) run in an order that rotates
from input to input, and inside a backend AR and SS run back to back in an order that alternates,
so drift, thermal and background load hit every row alike. `--repeats N` runs the whole input N
times in a row (rotation continuing) and keeps the median time of each run.
"""

from __future__ import annotations

import resource
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from streamfuse.runtime.backends.base import process_peak_rss_bytes
from streamfuse.runtime.measure.timing import timed_run
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace
from streamfuse.tools.bench_data import BenchInput
from streamfuse.tools.peers_runners import PeerRunner

TIMES = ("seconds", "ttft_s", "prefill_s")  # the per-run fields that repeats take the median of


@dataclass
class Engine:
    """One streamfuse backend: its loaded model, the settings of each method (run order) and traces."""

    loaded: Loaded
    settings: dict[str, DecodeSettings]
    traces: dict[str, Trace] = field(default_factory=dict)


def current_rss() -> int:
    """Resident memory now (the load-time growth of each backend and peer is measured with it)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def pair(engine: Engine, ids: list[int], run_id: str, flip: bool, traced: bool) -> dict[str, dict]:
    """Every method of one backend on one input, back to back; `flip` reverses the order."""
    methods = list(engine.settings)[::-1] if flip else list(engine.settings)
    return {
        m: timed_run(engine.loaded, ids, engine.settings[m], engine.traces.get(m) if traced else None, run_id)
        for m in methods
    }


def peer_run(runner: PeerRunner, ids: list[int], max_new_tokens: int) -> dict:
    result = runner.run(ids, max_new_tokens)
    return {
        "seconds": result.seconds,
        "new_tokens": result.new_tokens,
        "ttft_s": result.ttft_s,
        "token_ids": list(result.token_ids),
        "peak_memory_bytes": process_peak_rss_bytes(),
    }


def combine(runs: Sequence[dict]) -> dict:
    """Repeats of one run -> its first record with the median times (the tokens are the same: greedy)."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key in TIMES:
        if key in out:
            out[key] = statistics.median(r[key] for r in runs)
    out["seconds_repeats"] = [r["seconds"] for r in runs]
    out["peak_memory_bytes"] = max((r["peak_memory_bytes"] or 0) for r in runs)
    return out


@dataclass
class Matrix:
    engines: dict[str, Engine]  # backend name -> engine
    peers: dict[str, PeerRunner]
    peer_loaded: Loaded | None  # the torch model the peers share: their prompt ids and tokenizer
    max_new_tokens: int
    repeats: int = 1

    def units(self) -> list[tuple[str, str]]:
        return [("backend", b) for b in self.engines] + [("peer", p) for p in self.peers]

    def prompts(self, item: BenchInput) -> dict[tuple[str, str], list[int]]:
        ids = {("backend", b): prompt_ids(e.loaded, item.text, True) for b, e in self.engines.items()}
        if self.peer_loaded is not None:
            ids.update({("peer", p): prompt_ids(self.peer_loaded, item.text, True) for p in self.peers})
        return ids

    def run_unit(self, unit: tuple[str, str], ids: list[int], run_id: str, turn: int, traced: bool):
        kind, name = unit
        if kind == "backend":
            return pair(self.engines[name], ids, run_id, turn % 2 == 1, traced)
        return peer_run(self.peers[name], ids, self.max_new_tokens)

    def run_input(self, item: BenchInput, index: int, traced: bool) -> tuple[dict, dict]:
        """All units on one input, `repeats` times -> ({unit: combined record(s)}, {unit: prompt ids})."""
        units, ids = self.units(), self.prompts(item)
        runs: dict[tuple[str, str], list] = {u: [] for u in units}
        for repeat in range(self.repeats):
            turn = index * self.repeats + repeat
            shift = turn % len(units)
            for unit in units[shift:] + units[:shift]:
                runs[unit].append(self.run_unit(unit, ids[unit], item.id, turn, traced and repeat == 0))
        out = {}
        for unit, records in runs.items():
            if unit[0] == "backend":
                out[unit] = {m: combine([r[m] for r in records]) for m in records[0]}
            else:
                out[unit] = combine(records)
        return out, ids

    def text(self, unit: tuple[str, str], token_ids: list[int]) -> str:
        loaded = self.engines[unit[1]].loaded if unit[0] == "backend" else self.peer_loaded
        return loaded.tokenizer.decode(token_ids, skip_special_tokens=True).strip()


def run_matrix(matrix: Matrix, inputs: Sequence[BenchInput], warmup: int) -> tuple[list[dict], list[dict]]:
    """-> (rows: one per (input, backend) with a record per method and `same_tokens` (every method's = plain's),
    peer_rows: one per input with a record per peer). The first `warmup` inputs run once untimed first."""
    for index, item in enumerate(tqdm(inputs[:warmup], desc="warm-up", unit="input", dynamic_ncols=True)):
        matrix.run_input(item, index, traced=False)
    rows, peer_rows = [], []
    for index, item in enumerate(tqdm(inputs, desc="bench", unit="input", dynamic_ncols=True)):
        results, ids = matrix.run_input(item, index, traced=True)
        for unit, result in results.items():
            for record in result.values() if unit[0] == "backend" else [result]:
                record["text"] = matrix.text(unit, record["token_ids"])
        for backend in matrix.engines:
            methods = results[("backend", backend)]
            row = {"id": item.id, "backend": backend, "prompt_tokens": len(ids[("backend", backend)]), **methods}
            if len(methods) > 1:
                plain = methods[registry.plain()]["token_ids"]
                row["same_tokens"] = all(r["token_ids"] == plain for r in methods.values())
            rows.append(row)
        if matrix.peers:
            peer_rows.append(
                {
                    "id": item.id,
                    "prompt_tokens": len(ids[("peer", next(iter(matrix.peers)))]),
                    "results": {p: results[("peer", p)] for p in matrix.peers},
                }
            )
    return rows, peer_rows
