"""python export/build.py --task dialogsum (or python -m streamfuse.training.build): fine-tune, evaluate,
export and profile a Speculative Streaming model. Each stage reuses its output when rerun with the same settings (README: stages):
  data, train (SS model and LoRA baseline), distil (optional), evaluate, calibrate (acceptance model,
  step cost per tree), export (ExecuTorch, ONNX, Core ML), verify (parity gates the artifact), profile
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from streamfuse.adapters.base_model import DEFAULT_BASE_MODEL, base_gguf
from streamfuse.export.artifact import FORMATS
from streamfuse.runtime import cli
from streamfuse.training.config import PRESETS, BuildConfig, preset, with_overrides
from streamfuse.training.lock import exclusive
from streamfuse.training.pipeline import Build, run_build
from streamfuse.training.tasks import TASKS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=SET_HELP)
    parser.add_argument("--task", default="dialogsum", metavar="TASK[,TASK..]",
                        help=f"task to fine-tune on ({', '.join(sorted(TASKS))}); several, comma-separated, give one "
                             f"artifact: one base, each task's tensors beside it, switched at run time")
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                        help="smoke: minutes, tests the pipeline; cpu (default): about an hour on 2 cores; "
                             "cpu-distill: the benchmarked model, hours on 2 cores; paper: the paper's recipe, GPU")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field of the preset (repeatable); see below")
    parser.add_argument("--print-config", action="store_true", help="print the settings this build would use, then exit")
    parser.add_argument("--backends", default=None, help="export targets, comma-separated: torch, executorch, onnxruntime, "
                        "coreml, executorch_coreml ('torch' alone skips export; default: export.backends)")
    parser.add_argument("--quantize", default=None, help="weights: none, q4-native (the cpu presets' default), int8, "
                        "8da4w (export.quantize; docs/export.md)")
    parser.add_argument("--base-model", default=DEFAULT_BASE_MODEL,
                        help=f"'{DEFAULT_BASE_MODEL}' (bundled GGUF, converted once), a local HF folder, or a hub id")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder with the task's files (default: ../shared/data/<task> beside the repo, else the hub)")
    parser.add_argument("--work-dir", type=Path, default=Path("checkpoints"),
                        help="checkpoints, snapshots and eval results (default: checkpoints/); a run with changed "
                             "settings replaces <work-dir>/<task>-<preset>/ss, so give experiments their own")
    parser.add_argument("--out", type=Path, default=None, help="artifact folder (default: artifacts/<task>)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    cli.add_debug_flag(parser)
    args = parser.parse_args(argv)
    args.tasks = list(dict.fromkeys(t.strip() for t in args.task.split(",") if t.strip()))
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown or not args.tasks:
        parser.error(f"--task: unknown task {', '.join(map(repr, unknown)) or 'none given'}; known tasks: "
                     f"{', '.join(sorted(TASKS))}")
    args.task = args.tasks[0]
    args.out = args.out or Path("artifacts") / "+".join(args.tasks)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


SET_HELP = """--set SECTION.FIELD=VALUE changes one field of the preset; --print-config lists them all:
  streams.num_streams=3  streams.msa_layers=8  streams.init_rank=128   (gamma, N_s, f_eta rank)
  train.epochs=1.2  train.stream_weight=0.5  data.train_limit=100  data.test_limit=100
  distill.enabled=true  distill.main_targets=frozen  distill.unlabelled=true  (self-distillation)
  export.trees='gamma=3,k=1;gamma=3,k=2'  export.capacity=2048  export.draft_vocab=16384
  stages.baseline=false  stages.zero_shot=false  stages.profile_limit=20  stages.calibration_inputs=4
Values take the field's type (true/false, numbers, none where allowed, ';' between tuple items).
Settings that contradict each other are refused, naming the field to set."""


DRAFTERS = ("sd", "medusa", "parallelspec", "falcon", "specdec", "adaptive")  # config sections with their own drafter


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
    drafters = [name for name in DRAFTERS if getattr(config, name).enabled]
    if len(args.tasks) > 1 and drafters:
        raise ValueError(f"several tasks in one artifact carry SS and plain decoding; the drafters of "
                         f"{', '.join(drafters)} are per task: build them into a one-task artifact")
    return config


def task_runs(args: argparse.Namespace) -> list[tuple[argparse.Namespace, BuildConfig]]:
    """One build per task, in --task order, into the same artifact: the first makes the graphs, the others join."""
    return [(run, build_config(run)) for run in (argparse.Namespace(**{**vars(args), "task": t}) for t in args.tasks)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    runs = cli.usage(lambda: task_runs(args))  # bad settings fail before hours of training
    export = runs[0][1].export  # every task's graphs are the first's
    if export.quantize == "q4-native" and set(export.backends) & set(FORMATS["q4-native"]):
        base_gguf(args.base_model)  # the format's weights are the base GGUF's codes: refused now if there are none
    if args.print_config:
        configs = [{"task": run.task, **dataclasses.asdict(config)} for run, config in runs]
        print(json.dumps(configs[0] if len(configs) == 1 else configs, indent=2))
        return 0
    for run, config in runs:
        if len(runs) > 1:
            print(f"[tasks] {run.task} ({args.tasks.index(run.task) + 1} of {len(runs)}) into {args.out}", flush=True)
        build = Build(run, config)
        with exclusive(build.run_dir), exclusive(args.out):  # one build per checkpoint run and artifact folder
            if code := run_build(run, config, build):
                return code
    return 0


def console() -> int:
    """The `streamfuse-build` command: main with one-line errors."""
    return cli.run(main, prog="streamfuse-build")


if __name__ == "__main__":
    sys.exit(cli.run(main, prog="build.py"))
