"""streamfuse build --task dialogsum (or python -m streamfuse.training.build): fine-tune, evaluate,
export and profile a Speculative Streaming model. Each stage reuses its output when rerun with the same settings
(README: stages):
  data, train (SS model and LoRA baseline), distil (optional), evaluate, calibrate (acceptance model,
  step cost per tree), export (ExecuTorch, ONNX, Core ML), verify (parity gates the artifact), profile
"""

from __future__ import annotations

import json
import os
import sys

import torch

from streamfuse.adapters.base_model import base_gguf
from streamfuse.export.artifact import FORMATS
from streamfuse.runtime.commands import errors
from streamfuse.training.build_options import parse_args, task_runs
from streamfuse.training.lock import exclusive
from streamfuse.training.pipeline import Build, run_build


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    runs = errors.usage(lambda: task_runs(args))  # bad settings fail before hours of training
    export = runs[0][1].export  # every task's graphs are the first's
    if export.quantize == "q4-native" and set(export.backends) & set(FORMATS["q4-native"]):
        base_gguf(args.base_model)  # the format's weights are the base GGUF's codes: refused now if there are none
    if args.print_config:
        configs = [{"task": run.task, **config.as_dict()} for run, config in runs]
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


if __name__ == "__main__":
    sys.exit(errors.run(main, prog="build.py"))
