"""Timing on this device, for the build and the tools alike: the draft tree's calibration (step costs
of plain decoding and of each candidate tree, interleaved) and SS against plain decoding per input.

A library, no CLI: tools/calibrate.py and tools/bench.py are the entry points, and export/ runs these
in a fresh process at build time. Torch (its device name) and tqdm load only where they are used, so
an exported engine is timed without them.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

from streamfuse.runtime.artifact.format import Artifact
from streamfuse.runtime.backends.threads import use_threads
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.decode import generate
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DEFAULT_METHOD
from streamfuse.runtime.request.inputs import Input, prompt_ids
from streamfuse.runtime.request.loader import Loaded, load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import RunRecord, Trace
from streamfuse.runtime.speculation.calibration import (
    MAX_TREE_NODES,
    AcceptanceModel,
    BackendCalibration,
    Timings,
    calibrate,
)
from streamfuse.runtime.speculation.tree import TreeSpec


def device_name(device: str = "cpu") -> str:
    """The machine in words: the GPU's name, else the CPU model."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def candidates(loaded: Loaded, acceptance: AcceptanceModel, max_nodes: int) -> list[TreeSpec]:
    """The trees SS can draft here: torch, the best of each size; exported graphs, the best tree of up to
    each bucket's rows (a step costs its bucket's rows whatever the tree, so a smaller tree only loses)."""
    best = acceptance.best_trees(min(max_nodes, loaded.max_nodes or max_nodes, loaded.backend.max_positions))
    if loaded.max_nodes is None:
        return list(best.values())
    chosen, smaller = [], 0
    for rows in loaded.backend.spec.buckets:
        fits = [tree for nodes, tree in best.items() if smaller < nodes <= rows]
        if fits:
            chosen.append(max(fits, key=acceptance.expected_tokens))
        smaller = rows
    return chosen


def seconds_per_call(run: RunRecord) -> float | None:
    """Mean seconds of the calls after the prefill (each step, with its host work)."""
    calls = run.model_calls - 1
    return (run.seconds - run.spans["prefill"]) / calls if calls > 0 else None


def time_trees(
    loaded: Loaded,
    trees: Sequence[TreeSpec],
    prompts: Sequence[Sequence[int]],
    rules: StopRules,
    rounds: int = 1,
    both_ways: bool = True,
) -> Timings:
    """Per run (prompt x round): plain decoding's seconds per step, and each tree's, interleaved per
    prompt (the order rotating) so background load touches every candidate alike; with both_ways, a tree with a
    greedy_step graph both ways (that graph; a step, then a streams call); each tree's tokens per step over all its
    runs; every run's prefill seconds per prompt token."""
    from tqdm.auto import tqdm

    backend = loaded.backend
    plain: list[float] = []
    prefill: list[float] = []
    steps: dict[TreeSpec, list[float]] = {tree: [] for tree in trees}
    timed = ways(backend, trees, both_ways)
    two_calls: dict[TreeSpec, list[float]] = {tree: [] for tree, two in timed if two}
    made: dict[TreeSpec, list[int]] = {tree: [] for tree in trees}  # tokens of every speculative step
    jobs = [None, *timed]  # None: plain decoding
    for index in tqdm(range(rounds * len(prompts)), desc="calibrate", unit="input", dynamic_ncols=True):
        ids = prompts[index % len(prompts)]
        shift = index % len(jobs)
        for job in jobs[shift:] + jobs[:shift]:
            trace = Trace()
            if job is None:
                generate(backend, ids, DecodeSettings(BASELINE_METHOD, rules), trace=trace)
            else:
                tree, two = job
                backend.use_two_calls([tree] if two else ())
                generate(backend, ids, DecodeSettings(DEFAULT_METHOD, rules, tree=tree), trace=trace)
                made[tree] += [step.tokens for step in trace.runs[0].steps]
            seconds = seconds_per_call(trace.runs[0])
            prefill.append(trace.runs[0].spans["prefill"] / len(ids))
            if seconds is not None:
                (plain if job is None else (two_calls if job[1] else steps)[job[0]]).append(seconds)
    backend.use_two_calls(())
    realised = {tree: sum(tokens) / len(tokens) if tokens else 1.0 for tree, tokens in made.items()}
    return Timings(plain, steps, realised, prefill, sum(map(len, prompts)) / len(prompts), two_calls)


def ways(backend, trees: Sequence[TreeSpec], both_ways: bool) -> list[tuple[TreeSpec, bool]]:
    """(tree, two calls) for each way a greedy step of each tree is timed: its default (one greedy_step call where
    the tree has one), and with both_ways step then streams too, where that is another way; the backend is left
    with no two-call bucket."""
    backend.use_two_calls(())
    return [(t, False) for t in trees] + [(t, True) for t in trees if both_ways and backend.one_call(t)]


def calibrate_backend(
    loaded: Loaded,
    acceptance: AcceptanceModel,
    prompts: Sequence[Sequence[int]],
    rules: StopRules,
    device: str,
    threads: int,
    max_nodes: int = MAX_TREE_NODES,
    rounds: int = 1,
    both_ways: bool = True,
) -> BackendCalibration:
    trees = candidates(loaded, acceptance, max_nodes)
    if not trees:
        raise ValueError(
            f"{loaded.backend.name} has no draft tree it can run with {loaded.backend.num_streams} streams"
        )
    warm, backend = prompts[0][:8], loaded.backend
    for tree, two in ways(backend, trees, both_ways):  # engines may prepare a method on its first call
        backend.use_two_calls([tree] if two else ())
        generate(backend, warm, DecodeSettings(DEFAULT_METHOD, StopRules(2, rules.stop_token_ids), tree=tree))
    timings = time_trees(loaded, trees, prompts, rules, rounds, both_ways)
    return calibrate(acceptance, timings, device_name(device), threads)


def calibrate_sources(
    folder: Path,
    backend: str,
    sources: Sequence[str],
    threads: int | None,
    max_new_tokens: int,
    acceptance: dict | None = None,
    task: str | None = None,
) -> dict:
    """The build's call (in a fresh process): calibrate `backend` of an artifact for `task` (default: its own; or,
    with `acceptance` given, of a checkpoint: torch) on task source texts; returns the calibration as the manifest
    keeps it."""
    use_threads(threads)  # torch, where this process has it before the model loads
    model = AcceptanceModel.from_dict(acceptance) if acceptance else Artifact.open(folder, task).acceptance
    loaded = load(folder, backend, threads=threads, calibrated=False, task=task)
    prompts = [prompt_ids(loaded, text, True) for text in sources]
    # again: the torch backend brings torch with its model. Its calibration here picks the trees to export, timing
    # every size up to 16 nodes (2 min 17 s of make build on the Intel Xeon): one way only; streamfuse calibrate
    # times both.
    rules = StopRules(max_new_tokens, loaded.stop_token_ids)
    calibration = calibrate_backend(
        loaded, model, prompts, rules, "cpu", use_threads(threads), both_ways=backend != "torch"
    )
    print(report(calibration), flush=True)
    return calibration.to_dict()


def report(calibration: BackendCalibration) -> str:
    lines = [
        f"plain step: {1e3 * calibration.plain_seconds:.2f} ms on {calibration.device}, "
        f"{calibration.threads} threads; prefill {1e3 * calibration.prefill_seconds_per_token:.2f} ms per "
        f"prompt token",
        "nodes  tokens/step (model, timed runs)  step ms  x plain  expected speed-up  tree",
    ]
    for cost in sorted(calibration.trees, key=lambda c: c.tree.num_nodes):
        mark = " <- chosen" if cost.tree == calibration.tree else ""
        tree = cost.tree.to_dict()
        lines.append(
            f"{cost.tree.num_nodes:5d}  {cost.expected_tokens:11.3f}  {cost.realised_tokens:11.3f}  "
            f"{1e3 * cost.step_seconds:13.2f}  "
            f"{cost.step_seconds / calibration.plain_seconds:7.3f}  "
            f"{cost.speedup(calibration.plain_seconds):17.3f}  {tree['paths']} lookup {tree['lookup']}{mark}"
        )
        if cost.other_seconds is not None:
            ways = ("step, then streams", "greedy_step") if cost.two_calls else ("greedy_step", "step, then streams")
            lines.append(f"       greedy steps as {ways[0]}: {ways[1]} took {1e3 * cost.other_seconds:.2f} ms")
    return "\n".join(lines)


def summarise(rows: list[dict]) -> dict:
    """SS vs AR on one backend (rows of `interleaved`): the build's profile stage uses this shape."""
    ar, ss = BASELINE_METHOD, DEFAULT_METHOD
    ar_s = sum(r[ar]["seconds"] for r in rows)
    ss_s = sum(r[ss]["seconds"] for r in rows)
    tokens = sum(r[ss]["new_tokens"] for r in rows)
    return {
        "inputs": len(rows),
        "parity_mismatches": sum(not r["same_tokens"] for r in rows),
        "new_tokens": tokens,
        "call_reduction": tokens / sum(r[ss]["model_calls"] for r in rows),
        "speedup_total_time": ar_s / ss_s,
        "speedup_median_per_input": statistics.median(r[ar]["seconds"] / r[ss]["seconds"] for r in rows),
        f"{ar}_tokens_per_s_median": statistics.median(r[ar]["new_tokens"] / r[ar]["seconds"] for r in rows),
        f"{ss}_tokens_per_s_median": statistics.median(r[ss]["new_tokens"] / r[ss]["seconds"] for r in rows),
        f"{ar}_ttft_s_median": statistics.median(r[ar]["prefill_s"] for r in rows),
        f"{ss}_ttft_s_median": statistics.median(r[ss]["prefill_s"] for r in rows),
        f"{ss}_mean_tokens_per_step": statistics.mean(t for r in rows for t in r[ss]["step_tokens"]) if tokens else 0.0,
        "peak_memory_bytes": max((r[ss]["peak_memory_bytes"] or 0) for r in rows),
    }


def timed_run(loaded: Loaded, ids: list[int], settings: DecodeSettings, trace: Trace | None, run_id: str) -> dict:
    """One run as the bench records it: time, calls, per-step tokens, memory and the tokens."""
    # A disabled trace does not time spans, so an untraced run still gets a scratch one for its prefill.
    trace = trace if trace is not None and trace.enabled else Trace()
    result = Model(loaded).run(ids, settings=settings, trace=trace, run_id=run_id)
    record = result.record
    return {
        "seconds": record.seconds,
        "new_tokens": record.new_tokens,
        "model_calls": record.model_calls,
        "draft_calls": record.draft_calls,
        "prefill_s": record.spans["prefill"],
        "ttft_s": record.spans["prefill"],  # TTFT = the prefill span
        "step_tokens": [s.tokens for s in record.steps],
        "step_drafts": [s.tree_nodes - 1 for s in record.steps],
        "step_draft_s": [s.draft_seconds for s in record.steps],
        "peak_memory_bytes": record.peak_memory_bytes,
        "token_ids": result.token_ids,
    }


def interleaved(
    loaded: Loaded, requests: Sequence[Input], ss: DecodeSettings, ar: DecodeSettings, traces: dict, warmup: int
) -> list[dict]:
    """SS and AR per input on one backend, back to back, order alternating; the first `warmup` inputs untimed."""
    from tqdm.auto import tqdm

    settings = {BASELINE_METHOD: ar, DEFAULT_METHOD: ss}
    rows = []
    for index, request in enumerate(tqdm(requests, desc="bench", unit="input", dynamic_ncols=True)):
        ids = prompt_ids(loaded, request.text, True)
        warm = index < warmup
        order = list(settings)[::-1] if index % 2 == 1 else list(settings)
        results = {m: timed_run(loaded, ids, settings[m], None if warm else traces.get(m), request.id) for m in order}
        if not warm:
            rows.append(
                {
                    "id": request.id,
                    "prompt_tokens": len(ids),
                    **results,
                    "same_tokens": results[DEFAULT_METHOD]["token_ids"] == results[BASELINE_METHOD]["token_ids"],
                }
            )
    return rows
