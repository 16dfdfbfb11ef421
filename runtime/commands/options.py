"""The options every runtime entry point shares (generate, bench, calibrate, soak, memory, the demo),
defined once so they mean and check the same everywhere: the model folder, the engine(s), their
threads, the torch device and streams schedule, the draft tree. Each tool states only its defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from streamfuse.runtime.artifact.contract import STREAM_SCHEDULES  # --stream-schedule's choices
from streamfuse.runtime.request.loader import BACKENDS

FASTEST = None  # --backend's default where a tool takes the fastest the artifact has here (runtime/request/loader.py)


def add_model_options(
    parser: argparse.ArgumentParser,
    *,
    artifact: str = "required",
    backend: str | None = FASTEST,
    backend_required: bool = False,
    backends: str | None = None,
    threads: int | None = None,
    device: bool = True,
    schedule: bool = True,
    tree: str | None = None,
) -> None:
    """artifact: "required", or "optional: <what no --artifact means>". backend: --backend's default (FASTEST: the
    fastest the artifact has here); backends: a default for --backends (comma-separated, several engines in one
    run) instead of --backend. threads: --threads' default (None: each engine's own). tree: --tree's help for
    what no --tree means (None: the tool has no --tree)."""
    group = parser.add_argument_group("model and engine")
    what = "an exported artifact (artifacts/<task>, any backend it was built for) or a fine-tuned checkpoint folder "
    what += "(torch only), made by streamfuse build"
    if artifact == "required":
        group.add_argument("--artifact", type=Path, required=True, help=what)
    else:
        absent = artifact.removeprefix("optional: ")
        group.add_argument("--artifact", type=Path, default=None, help=f"{what} ({absent})")
    if backends is not None:
        group.add_argument(
            "--backends",
            default=backends,
            help=f"engines, comma-separated among {', '.join(BACKENDS)} "
            f"(default: {backends or 'the fastest the artifact has here'})",
        )
    elif backend_required:
        group.add_argument("--backend", choices=BACKENDS, required=True, help="the engine")
    else:
        group.add_argument(
            "--backend",
            choices=BACKENDS,
            default=backend,
            help="the engine (default: " + (backend or "the fastest the artifact has here, by its calibrations") + ")",
        )
    group.add_argument(
        "--threads",
        type=int,
        default=threads,
        help=f"CPU threads of every engine (default: {threads or 'each engine its own'})",
    )
    if device:
        group.add_argument("--device", default="cpu", help="the torch backend's device (cpu, cuda, cuda:1, ...)")
    if schedule:
        group.add_argument(
            "--stream-schedule",
            choices=STREAM_SCHEDULES,
            default="fused",
            help="the torch backend's streams: fused, at every tree node in the verify pass "
            "(memory-bound devices); deferred, for the last accepted node only, after it (CPUs)",
        )
    if tree is not None:
        group.add_argument(
            "--tree",
            default=None,
            help=f"draft tree: 'gamma=G,k=K', a JSON list of paths or a JSON file (default: {tree})",
        )


def check_model_options(args: argparse.Namespace) -> None:
    """The shared options' values, before any (slow) model load: a bad one is the user's to fix (exit 2)."""
    from streamfuse.runtime.backends.threads import check_threads
    from streamfuse.runtime.commands.errors import usage

    usage(lambda: check_threads(args.threads))
