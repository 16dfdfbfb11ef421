"""streamfuse calibrate: choose the draft tree for this device and backend.

    OMP_WAIT_POLICY=PASSIVE streamfuse calibrate --artifact artifacts/dialogsum \
        --backend executorch --threads 2

The artifact's manifest holds the acceptance model, measured at export on validation dialogues
(runtime/speculation/calibration.py). This times, on this device, a plain decoding step and a speculative step
of each candidate tree: the best tree of every size up to --max-nodes (torch), or of each step graph's
size bucket (the exported engines), all on the same validation dialogues, interleaved (runtime/measure/timing.py). Each
candidate's expected tokens per step over its measured cost picks the tree; the choice, every
candidate's cost and the plain step's go into the manifest (calibration.backends.<backend>), where
the runtime reads its default tree and its fallback threshold. Run it again on each new device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from streamfuse.runtime.artifact.format import Artifact, ArtifactError
from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.options import add_model_options, check_model_options
from streamfuse.runtime.measure.timing import calibrate_backend, report
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.loader import Loaded, load
from streamfuse.runtime.speculation.calibration import MAX_TREE_NODES
from streamfuse.tools.bench_data import read_inputs, task_file


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--input-file", type=Path, default=None, help="JSON lines of task inputs (default: the task's validation split)"
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="folder holding the task's files")
    parser.add_argument("--limit", type=int, default=4, help="inputs timed (default 4)")
    parser.add_argument("--rounds", type=int, default=1, help="times each input is timed")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per timed run")
    parser.add_argument(
        "--max-nodes", type=int, default=MAX_TREE_NODES, help="largest tree to try where any tree runs (torch)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the calibration, leave the manifest as it is")
    parser.add_argument(
        "--task", default=None, help="on an artifact with several tasks: the one to calibrate (default: its own)"
    )
    add_model_options(parser, backend_required=True)
    errors.add_debug_flag(parser)
    return parser.parse_args(argv)


def inputs_for(args: argparse.Namespace, loaded: Loaded) -> list[list[int]]:
    task = loaded.info.get("task")
    if loaded.prompt is None:
        raise ValueError(f"{args.artifact} records no task prompt; rebuild it with streamfuse build")
    path = args.input_file or task_file(task, "validation", args.data_dir)
    return [prompt_ids(loaded, item.text, True) for item in read_inputs(path, loaded.prompt, args.limit)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_model_options(args)  # --threads within this machine's cores, before any load
    for flag in ("limit", "rounds", "max_new_tokens", "threads"):
        value = getattr(args, flag)
        errors.check(value is None or value >= 1, f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    errors.check(args.max_nodes >= 2, f"--max-nodes must be >= 2 (a root and one draft), got {args.max_nodes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    artifact = Artifact.open(args.artifact, args.task)
    acceptance = artifact.acceptance
    if acceptance is None:
        raise ArtifactError(
            f"{args.artifact} has no acceptance model; rebuild it with this streamfuse "
            f"(streamfuse build measures one on validation dialogues)"
        )
    loaded = load(
        args.artifact, args.backend, args.device, args.stream_schedule, args.threads, calibrated=False, task=args.task
    )
    prompts = inputs_for(args, loaded)
    calibration = calibrate_backend(
        loaded,
        acceptance,
        prompts,
        StopRules(args.max_new_tokens, loaded.stop_token_ids),
        args.device,
        torch.get_num_threads(),
        args.max_nodes,
        args.rounds,
    )
    print(report(calibration))
    if not args.dry_run:
        artifact.save_calibration(args.backend, calibration)
        print(f"[calibrate] {args.backend}: written to {args.artifact / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
