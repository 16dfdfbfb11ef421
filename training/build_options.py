"""The build's command line as a library: its flags, and the BuildConfig they give (`streamfuse build` runs
them; methods' own tools, such as Falcon's held-out sweep, take the same flags)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from streamfuse.adapters.base_model import DEFAULT_BASE_MODEL
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.commands import errors
from streamfuse.training import build_part
from streamfuse.training.config import PRESETS, BuildConfig, preset, with_overrides
from streamfuse.training.tasks import TASKS

DESCRIPTION = """streamfuse build --task dialogsum (or python -m streamfuse.training.build): fine-tune, evaluate,
export and profile a Speculative Streaming model. Each stage reuses its output when rerun with the same settings
(README: stages):
  data, train (SS model and LoRA baseline), distil (optional), evaluate, calibrate (acceptance model,
  step cost per tree), export (ExecuTorch, ONNX, Core ML), verify (parity gates the artifact), profile
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SET_HELP
    )
    parser.add_argument(
        "--task",
        default="dialogsum",
        metavar="TASK[,TASK..]",
        help=f"task to fine-tune on ({', '.join(sorted(TASKS))}); several, comma-separated, give one "
        f"artifact: one base, each task's tensors beside it, switched at run time",
    )
    parser.add_argument(
        "--preset",
        default="cpu",
        choices=sorted(PRESETS),
        help="smoke: minutes, tests the pipeline; cpu (default): 32-89 min on 2 cores (README); "
        "cpu-distill: the benchmarked model, hours on 2 cores; paper: the paper's recipe, GPU",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one field of the preset (repeatable); see below",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the settings this build would use, then exit"
    )
    parser.add_argument(
        "--backends",
        default=None,
        help="export targets, comma-separated: torch, executorch, "
        "onnxruntime, coreml, executorch_coreml ('torch' alone skips export; default: export.backends)",
    )
    parser.add_argument(
        "--quantize",
        default=None,
        help="weights: none, q4-native (the cpu presets' default), int8, 8da4w (export.quantize; docs/export.md)",
    )
    parser.add_argument(
        "--base-model",
        default=DEFAULT_BASE_MODEL,
        help=f"'{DEFAULT_BASE_MODEL}' (bundled GGUF, converted once), a local HF folder, or a hub id",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="folder with the task's files (default: ../shared/data/<task> beside the repo, else the hub)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path("checkpoints"),
        help="checkpoints, snapshots and eval results (default: checkpoints/); a run with changed "
        "settings replaces <work-dir>/<task>-<preset>/ss, so give experiments their own",
    )
    parser.add_argument("--out", type=Path, default=None, help="artifact folder (default: artifacts/<task>)")
    parser.add_argument(
        "--threads", type=threads_type, default=None, help="torch CPU threads (default: torch's choice)"
    )
    errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    args.tasks = list(dict.fromkeys(t.strip() for t in args.task.split(",") if t.strip()))
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown or not args.tasks:
        parser.error(
            f"--task: unknown task {', '.join(map(repr, unknown)) or 'none given'}; known tasks: "
            f"{', '.join(sorted(TASKS))}"
        )
    args.task = args.tasks[0]
    args.out = args.out or Path("artifacts") / "+".join(args.tasks)
    return args


SET_HELP = """--set SECTION.FIELD=VALUE changes one field of the preset; --print-config lists them all:
  streams.num_streams=3  streams.msa_layers=4  streams.init_rank=128   (gamma, N_s, f_eta rank)
  train.epochs=1.2  train.stream_weight=0.5  data.train_limit=100  data.test_limit=100
  distill.enabled=true  distill.main_targets=frozen  distill.unlabelled=true  (self-distillation)
  export.trees='gamma=3,k=1;gamma=3,k=2'  export.capacity=2048  export.draft_vocab=16384
  stages.baseline=false  stages.zero_shot=false  stages.profile_limit=20  stages.calibration_inputs=4
Values take the field's type (true/false, numbers, none where allowed, ';' between tuple items).
Settings that contradict each other are refused, naming the field to set."""


def build_config(args: argparse.Namespace) -> BuildConfig:
    """The preset with args.task's cpu settings, then --backends / --quantize (several tasks: graphs that take the
    task's tensors as inputs), then each --set in order; validated."""
    config = preset(args.preset)
    if args.preset.startswith("cpu"):
        config = with_overrides(config, list(TASKS[args.task].cpu_settings))
    if len(args.tasks) > 1:
        config = dataclasses.replace(config, export=dataclasses.replace(config.export, task_inputs=True))
    export = {}
    if args.backends is not None:
        export["backends"] = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    if args.quantize is not None:
        export["quantize"] = args.quantize
    if export:
        config = dataclasses.replace(config, export=dataclasses.replace(config.export, **export))
    config = with_overrides(config, args.set)
    config.validate()
    drafters = [part.section for part in build_part.enabled(config)]
    if len(args.tasks) > 1 and drafters:
        raise ValueError(
            f"several tasks in one artifact carry SS and plain decoding; the drafters of "
            f"{', '.join(drafters)} are per task: build them into a one-task artifact"
        )
    return config


def task_runs(args: argparse.Namespace) -> list[tuple[argparse.Namespace, BuildConfig]]:
    """One build per task, in --task order, into the same artifact: the first makes the graphs, the others join."""
    return [(run, build_config(run)) for run in (argparse.Namespace(**{**vars(args), "task": t}) for t in args.tasks)]
