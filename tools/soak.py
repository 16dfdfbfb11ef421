"""streamfuse soak: one loaded artifact, many generations; memory and file handles stay flat.

    streamfuse soak --artifact artifacts/dialogsum --backend executorch --generations 1000

An app keeps one model open for hours: a leak per generation (a cache not freed, a handle not
closed) shows only after many. This loads the backend once and decodes the task's validation
inputs round-robin, SS and plain decoding in turn, for --generations runs. After the warm-up
generations (allocator pools and lazily built kernels settle), it compares resident memory
(VmRSS) and open file descriptors with the end: the run passes when RSS grew by less than
--max-growth (2 %) and no descriptor was left open. Linux: it reads /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from streamfuse.runtime.commands import errors
from streamfuse.runtime.commands.options import add_model_options, check_model_options
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.frontend import BASELINE_METHOD, DecodeRequest, decode_settings
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.loader import Loaded, load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.tools.bench_data import read_inputs, task_file
from streamfuse.tools.process_memory import status

MAX_GROWTH = 0.02


@dataclass(frozen=True)
class SoakResult:
    generations: int
    warmup: int
    rss_after_warmup: int  # bytes
    rss_end: int
    rss_peak_after_warmup: int  # the largest of the samples taken every `sample_every` generations
    fds_after_warmup: int
    fds_end: int
    tokens: int

    @property
    def growth(self) -> float:
        return (self.rss_end - self.rss_after_warmup) / self.rss_after_warmup

    def passed(self, max_growth: float = MAX_GROWTH) -> bool:
        return self.growth < max_growth and self.fds_end <= self.fds_after_warmup

    def to_dict(self) -> dict:
        return {**asdict(self), "growth": self.growth}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(
    loaded: Loaded,
    prompts: list[list[int]],
    settings: DecodeSettings,
    generations: int,
    warmup: int,
    sample_every: int = 50,
) -> SoakResult:
    """Decode prompts round-robin, SS then plain in turn; RSS and descriptors after warm-up and at the end."""
    methods = (settings, replace(settings, method=BASELINE_METHOD))
    rss_warm = fds_warm = peak = tokens = 0
    model = Model(loaded)
    for index in tqdm(range(generations), desc="soak", unit="gen", dynamic_ncols=True):
        result = model.run(prompts[index % len(prompts)], settings=methods[index % 2])
        tokens += len(result.token_ids)
        done = index + 1
        if done == warmup:
            rss_warm, fds_warm = status()["VmRSS"], open_fds()
        if done > warmup and done % sample_every == 0:
            peak = max(peak, status()["VmRSS"])
    rss_end = status()["VmRSS"]
    return SoakResult(generations, warmup, rss_warm, rss_end, max(peak, rss_end), fds_warm, open_fds(), tokens)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=1000, help="generations in all (default 1000)")
    parser.add_argument("--warmup", type=int, default=100, help="generations before the first measurement")
    parser.add_argument(
        "--input-file", type=Path, default=None, help="JSON lines of task inputs (default: the task's validation split)"
    )
    parser.add_argument("--limit", type=int, default=20, help="distinct inputs, decoded round-robin")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-growth", type=float, default=MAX_GROWTH, help="RSS growth allowed after warm-up")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    add_model_options(parser, backend="torch", threads=2, device=False, schedule=False)
    errors.add_debug_flag(parser)
    args = parser.parse_args(argv)
    if min(args.generations, args.limit, args.threads, args.max_new_tokens) < 1:
        parser.error("--generations, --limit, --threads and --max-new-tokens must be >= 1")
    if not 0 < args.warmup < args.generations:
        parser.error(f"--warmup must be between 1 and --generations - 1, got {args.warmup}")
    if not Path("/proc/self/fd").is_dir():
        parser.error("soak reads /proc: run it on Linux")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_model_options(args)  # --threads within this machine's cores, before any load
    loaded = load(args.artifact, args.backend, threads=args.threads)
    if loaded.prompt is None:
        raise errors.UsageError(f"{args.artifact} records no task prompt; rebuild it with streamfuse build")
    path = args.input_file or task_file(loaded.info.get("task"), "validation", None)
    prompts = [prompt_ids(loaded, item.text, True) for item in read_inputs(path, loaded.prompt, args.limit)]
    settings = decode_settings(loaded, DecodeRequest(max_new_tokens=args.max_new_tokens))
    result = soak(loaded, prompts, settings, args.generations, args.warmup)
    record = {
        "artifact": str(args.artifact),
        "backend": args.backend,
        **result.to_dict(),
        "passed": result.passed(args.max_growth),
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2))
    print(
        f"[soak] {args.backend}: {result.generations} generations ({result.tokens} tokens); RSS "
        f"{result.rss_after_warmup / 2**20:.1f} MiB after {result.warmup} -> {result.rss_end / 2**20:.1f} MiB "
        f"at the end "
        f"({100 * result.growth:+.2f} %, peak {result.rss_peak_after_warmup / 2**20:.1f} MiB); open files "
        f"{result.fds_after_warmup} -> {result.fds_end}: {'flat' if record['passed'] else 'GROWING'}"
    )
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(errors.run(main, prog="soak"))
