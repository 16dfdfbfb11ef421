"""python -m streamfuse.tools.calibrate: choose the draft tree for this device and backend.

    OMP_WAIT_POLICY=PASSIVE python -m streamfuse.tools.calibrate --artifact artifacts/dialogsum \
        --backend executorch --threads 2

The artifact's manifest holds the acceptance model, measured at export on validation dialogues
(runtime/calibration.py). This times, on this device, a plain decoding step and a speculative step
of each candidate tree: the best tree of every size up to --max-nodes (torch), or of each step graph's
size bucket (the exported engines), all on the same validation dialogues, interleaved. Each
candidate's expected tokens per step over its measured cost picks the tree; the choice, every
candidate's cost and the plain step's go into the manifest (calibration.backends.<backend>), where
the runtime reads its default tree and its fallback threshold. Run it again on each new device.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from streamfuse.runtime import cli
from streamfuse.runtime.artifact import Artifact, ArtifactError
from streamfuse.runtime.calibration import MAX_TREE_NODES, AcceptanceModel, BackendCalibration, Timings, calibrate
from streamfuse.runtime.decode import generate
from streamfuse.runtime.emitter import StopRules
from streamfuse.runtime.generate import prompt_ids
from streamfuse.runtime.loader import BACKENDS, Loaded, load
from streamfuse.runtime.settings import DecodeSettings
from streamfuse.runtime.trace import RunRecord, Trace
from streamfuse.runtime.tree import TreeSpec
from streamfuse.tools.bench_data import read_inputs, task_file


def device_name(device: str = "cpu") -> str:
    """The machine in words: the GPU's name, else the CPU model."""
    if device.startswith("cuda"):
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


def time_trees(loaded: Loaded, trees: Sequence[TreeSpec], prompts: Sequence[Sequence[int]], rules: StopRules,
               rounds: int = 1) -> Timings:
    """Per run (prompt x round): plain decoding's seconds per step, and each tree's, interleaved per
    prompt (the order rotating) so background load touches every candidate alike; each tree's tokens
    per step over all its runs; every run's prefill seconds per prompt token."""
    plain: list[float] = []
    prefill: list[float] = []
    steps: dict[TreeSpec, list[float]] = {tree: [] for tree in trees}
    made: dict[TreeSpec, list[int]] = {tree: [] for tree in trees}  # tokens of every speculative step
    jobs = [None, *trees]  # None: plain decoding
    for index in tqdm(range(rounds * len(prompts)), desc="calibrate", unit="input", dynamic_ncols=True):
        ids = prompts[index % len(prompts)]
        shift = index % len(jobs)
        for job in jobs[shift:] + jobs[:shift]:
            trace = Trace()
            if job is None:
                generate(loaded.backend, ids, DecodeSettings("ar", rules), trace=trace)
            else:
                generate(loaded.backend, ids, DecodeSettings("ss", rules, tree=job), trace=trace)
            seconds = seconds_per_call(trace.runs[0])
            prefill.append(trace.runs[0].spans["prefill"] / len(ids))
            if seconds is not None:
                (plain if job is None else steps[job]).append(seconds)
            if job is not None:
                made[job] += [step.tokens for step in trace.runs[0].steps]
    realised = {tree: sum(tokens) / len(tokens) if tokens else 1.0 for tree, tokens in made.items()}
    return Timings(plain, steps, realised, prefill, sum(map(len, prompts)) / len(prompts))


def calibrate_backend(loaded: Loaded, acceptance: AcceptanceModel, prompts: Sequence[Sequence[int]],
                      rules: StopRules, device: str, threads: int, max_nodes: int = MAX_TREE_NODES,
                      rounds: int = 1) -> BackendCalibration:
    trees = candidates(loaded, acceptance, max_nodes)
    if not trees:
        raise ValueError(f"{loaded.backend.name} has no draft tree it can run with {loaded.backend.num_streams} streams")
    warm = prompts[0][:8]
    for tree in trees:  # engines may prepare a method on its first call
        generate(loaded.backend, warm, DecodeSettings("ss", StopRules(2, rules.stop_token_ids), tree=tree))
    return calibrate(acceptance, time_trees(loaded, trees, prompts, rules, rounds), device_name(device), threads)


def calibrate_sources(folder: Path, backend: str, sources: Sequence[str], threads: int | None, max_new_tokens: int,
                      acceptance: dict | None = None) -> dict:
    """The build's call (in a fresh process): calibrate `backend` of an artifact (or, with `acceptance`
    given, of a checkpoint: torch) on task source texts; returns the calibration as the manifest keeps it."""
    if threads:
        torch.set_num_threads(threads)
    model = AcceptanceModel.from_dict(acceptance) if acceptance else Artifact.open(folder).acceptance
    loaded = load(folder, backend, threads=threads, calibrated=False)
    prompts = [prompt_ids(loaded, text, True) for text in sources]
    calibration = calibrate_backend(loaded, model, prompts, StopRules(max_new_tokens, loaded.stop_token_ids), "cpu",
                                    torch.get_num_threads())
    print(report(calibration), flush=True)
    return calibration.to_dict()


def report(calibration: BackendCalibration) -> str:
    lines = [f"plain step: {1e3 * calibration.plain_seconds:.2f} ms on {calibration.device}, "
             f"{calibration.threads} threads; prefill {1e3 * calibration.prefill_seconds_per_token:.2f} ms per prompt token",
             "nodes  tokens/step (model, timed runs)  step ms  x plain  expected speed-up  tree"]
    for cost in sorted(calibration.trees, key=lambda c: c.tree.num_nodes):
        mark = " <- chosen" if cost.tree == calibration.tree else ""
        tree = cost.tree.to_dict()
        lines.append(f"{cost.tree.num_nodes:5d}  {cost.expected_tokens:11.3f}  {cost.realised_tokens:11.3f}  "
                     f"{1e3 * cost.step_seconds:13.2f}  "
                     f"{cost.step_seconds / calibration.plain_seconds:7.3f}  "
                     f"{cost.speedup(calibration.plain_seconds):17.3f}  {tree['paths']} lookup {tree['lookup']}{mark}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="exported artifact (export/build.py)")
    parser.add_argument("--backend", choices=BACKENDS, required=True, help="the engine to calibrate on this device")
    parser.add_argument("--input-file", type=Path, default=None,
                        help="JSON lines of task inputs (default: the task's validation split)")
    parser.add_argument("--data-dir", type=Path, default=None, help="folder holding the task's files")
    parser.add_argument("--limit", type=int, default=4, help="inputs timed (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="times each input is timed")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per timed run")
    parser.add_argument("--max-nodes", type=int, default=MAX_TREE_NODES,
                        help="largest tree to try where any tree runs (torch)")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    parser.add_argument("--stream-schedule", default="fused", choices=("fused", "deferred"),
                        help="the torch backend's streams schedule")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    parser.add_argument("--dry-run", action="store_true", help="print the calibration, leave the manifest as it is")
    cli.add_debug_flag(parser)
    return parser.parse_args(argv)


def inputs_for(args: argparse.Namespace, loaded: Loaded) -> list[list[int]]:
    task = loaded.info.get("task")
    if loaded.prompt is None:
        raise ValueError(f"{args.artifact} records no task prompt; rebuild it with export/build.py")
    path = args.input_file or task_file(task, "validation", args.data_dir)
    return [prompt_ids(loaded, item.text, True) for item in read_inputs(path, loaded.prompt, args.limit)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for flag in ("limit", "rounds", "max_new_tokens", "threads"):
        value = getattr(args, flag)
        cli.check(value is None or value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    cli.check(args.max_nodes >= 2, f"--max-nodes must be >= 2 (a root and one draft), got {args.max_nodes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    artifact = Artifact.open(args.artifact)
    acceptance = artifact.acceptance
    if acceptance is None:
        raise ArtifactError(f"{args.artifact} has no acceptance model; rebuild it with this streamfuse "
                            f"(export/build.py measures one on validation dialogues)")
    loaded = load(args.artifact, args.backend, args.device, args.stream_schedule, args.threads, calibrated=False)
    prompts = inputs_for(args, loaded)
    calibration = calibrate_backend(loaded, acceptance, prompts, StopRules(args.max_new_tokens, loaded.stop_token_ids),
                                    args.device, torch.get_num_threads(), args.max_nodes, args.rounds)
    print(report(calibration))
    if not args.dry_run:
        artifact.save_calibration(args.backend, calibration)
        print(f"[calibrate] {args.backend}: written to {args.artifact / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
