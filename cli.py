"""`streamfuse <command> [args]`: the project's one console script.

Each command is one module's `main(argv)`, imported only when that command runs: `streamfuse --help` reads the
table below and imports none of them (no torch). `python -m streamfuse.<module>` runs the same `main`.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # the module whose main(argv) the command runs
    summary: str  # its line in `streamfuse --help`


COMMANDS: dict[str, Command] = {
    "build": Command("streamfuse.training.build", "fine-tune, evaluate, calibrate, export, verify and profile a model"),
    "generate": Command("streamfuse.runtime.commands.generate", "decode prompts or a task's inputs with an artifact"),
    "bench": Command("streamfuse.tools.bench", "methods x backends x peers on a task split, interleaved"),
    "calibrate": Command("streamfuse.tools.calibrate", "choose the draft tree for this device and backend"),
    "profile": Command("streamfuse.tools.profiler", "call reduction, acceptance and time split of a decode trace"),
    "demo": Command("streamfuse.apps.demo", "desktop demo: two methods decoding side by side"),
    "serve": Command("streamfuse.apps.server", "an OpenAI-compatible HTTP server, concurrent requests batched"),
}
TOOLS: dict[str, Command] = {
    "probe": Command("streamfuse.tools.probe", "hostile inputs through the CLI, the API and tampered artifacts"),
    "soak": Command("streamfuse.tools.soak", "many generations on one loaded artifact: memory and handles stay flat"),
    "memory": Command("streamfuse.tools.memory", "memory an engine adds at load and at its peak, each in its process"),
    "footprint": Command("streamfuse.tools.footprint", "a decoding process's import time, memory and modules"),
    "task-switch": Command("streamfuse.tools.task_switch", "an artifact's tasks in turn on one loaded engine"),
    "call-times": Command("streamfuse.tools.call_times", "each method's call time on one engine, by cache slots used"),
    "op-profile": Command("streamfuse.tools.op_profile", "where each ms of decode, step and greedy step goes, per op"),
    "latency": Command("streamfuse.tools.latency", "per-call latency of a plain step vs a tree step (torch)"),
    "graph-latency": Command("streamfuse.tools.graph_latency", "per-call latency of the exported graphs (onnxruntime)"),
    "span-sweep": Command("streamfuse.tools.span_sweep", "step time of the exported graphs by engine, span and rows"),
    "draft-latency": Command("streamfuse.tools.draft_latency", "a draft model's call by LM head size, per engine"),
    "pearl-replay": Command("streamfuse.tools.pearl_replay", "PEARL and two-model SD on other devices' call times"),
    "roofline": Command("streamfuse.tools.roofline", "projected step cost and speed-up on devices not at hand"),
    "q4-bench": Command("streamfuse.tools.q4_bench", "what M rows cost a 4-bit linear, ours against the engines'"),
    "linear-bench": Command("streamfuse.tools.linear_bench", "one linear layer: eager torch, packed, XNNPACK"),
    "peers": Command("streamfuse.tools.peers", "peer baselines (transformers, llama.cpp, optimum-executorch)"),
    "peers-native": Command("streamfuse.tools.peers_native", "llama.cpp's own llama-bench, in its own processes"),
    "load-test": Command("streamfuse.tools.load_test", "many clients against the server: outputs exact, RSS flat"),
    "batch-bench": Command("streamfuse.tools.batch_bench", "B concurrent requests per step: tokens/s, time to first"),
}
ALL: dict[str, Command] = {**COMMANDS, **TOOLS}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("streamfuse")
    except PackageNotFoundError:
        return "not installed"


def help_text() -> str:
    width = max(map(len, ALL)) + 2

    def rows(table: dict[str, Command]) -> str:
        return "\n".join(f"  {name:<{width}}{command.summary}" for name, command in table.items())

    return (
        f"usage: streamfuse <command> [args]\n\n"
        f"Speculative Streaming for on-device LLM inference: fine-tune, export, run.\n"
        f"`streamfuse <command> --help` shows a command's own flags.\n\n"
        f"commands:\n{rows(COMMANDS)}\n\ntools:\n{rows(TOOLS)}\n\n"
        f"options:\n  {'-h, --help':<{width}}this list\n  {'--version':<{width}}the installed version\n"
    )


def unknown(name: str) -> str:
    """The one error line for a word that names no command."""
    if name.startswith("-"):
        return f"unknown option {name!r}: give a command first, or --help, or --version"
    closest = difflib.get_close_matches(name, ALL, n=1, cutoff=0.0)
    return f"unknown command {name!r}; the closest is {closest[0]!r} (streamfuse --help lists them)"


def run(name: str, argv: list[str]) -> int:
    """`streamfuse <name> argv`: the command's main under the project's one-line errors, its prog `streamfuse
    <name>` (argparse reads its default prog from sys.argv[0])."""
    from streamfuse.runtime.commands.errors import run as with_one_line_errors

    prog = f"streamfuse {name}"
    main = importlib.import_module(ALL[name].module).main
    invoked_as = sys.argv[0]
    sys.argv[0] = prog
    try:
        return with_one_line_errors(main, argv, prog=prog)
    finally:
        sys.argv[0] = invoked_as


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(
            "streamfuse: error: name a command: streamfuse <command> [args] (streamfuse --help lists them)",
            file=sys.stderr,
        )
        return 2
    first, rest = argv[0], argv[1:]
    if first in ("-h", "--help"):
        print(help_text(), end="")
        return 0
    if first == "--version":
        print(f"streamfuse {version()}")
        return 0
    name = first.replace("_", "-")
    if name not in ALL:
        print(f"streamfuse: error: {unknown(first)}", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
