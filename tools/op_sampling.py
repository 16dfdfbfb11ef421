"""ExecuTorch's op time where its runtime records no ETDump (the pip wheel is built without the event tracer):
perf's CPU samples of this process by kernel symbol, leaf frame first (SYMBOLS), for tools/op_profile.py. The linears
are not split by layer (XNNPACK's microkernels carry no symbols; a sample in its library without one is its compute),
and each call's buckets are its samples' shares of its own wall time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from streamfuse.runtime.commands import errors

NO_ETDUMP = (
    "executorch: this runtime records no ETDump (its wheel is built without EXECUTORCH_ENABLE_EVENT_TRACER): its "
    "buckets are perf's CPU samples by kernel symbol (SYMBOLS), the linears not split by layer, scaled to each call"
)
# (pattern found in a sample's symbol, leaf frame first, then its callers; bucket): ExecuTorch without ETDump
SYMBOLS: tuple[tuple[str, str], ...] = (
    (r"tree_attention|attend_|validate_attention", "attention kernel"),
    (r"commit_rows", "cache commit"),
    (r"q4_linear|q8_tiles|run_linear|q4_|q8_", "linears: streamfuse op (all)"),
    # XNNPACK's microkernels carry no symbols: a sample in its library (the runtime's Python binding, which links
    # XNNPACK in) without one is its compute (linears)
    (
        r"xnn_.*(gemm|igemm|fully_connected|batch_matrix|qc4w|qc8w|qd8|qp8)|\[unknown\] \(.*/pybindings/",
        "linears: XNNPACK (all)",
    ),
    (r"topk|argmax|argmin|max_out", "top-k / accept"),
    (r"rsqrt|rms_norm|mean_|layer_norm", "norms"),
    (r"(^|\W)(sin|cos)(_out|f)?\b", "RoPE"),
    (r"sigmoid|silu|vmul|vadd|vsub|vbinary|vunary|mul_out|add_out|sub_out|div_out|xnn_f32_v", "elementwise (SwiGLU..)"),
    (
        r"cat_out|copy|memcpy|memmove|memset|slice|permute|transpose|expand|index|gather|select|clone|where|view_",
        "copies / concats / other",
    ),
    (
        r"pthreadpool|thread_main|thread_parallelize|futex|sched_yield|nanosleep|spin|finish_task_switch|syscall|"
        r"schedule|__GI___poll",
        "threadpool wait, system",
    ),
    (
        r"executorch|Method|pybind|_Py|Py[A-Z]|libpython|python3|torch::|c10::|at::|malloc|free|_alloc|unicode|dict",
        "runtime dispatch (ET, Python)",
    ),
)


def symbol_bucket(frames: Sequence[str]) -> str:
    """A perf sample's bucket: the first SYMBOLS rule that matches its leaf frame, else its nearest caller."""
    for frame in frames:
        for pattern, bucket in SYMBOLS:
            if re.search(pattern, frame):
                return bucket
    return "other (unresolved symbols)"


def perf_runs(
    session, calls: list[tuple[str, list[np.ndarray]]], folder: Path, beside=None
) -> tuple[list[dict], list[float]]:
    """Each call's CPU samples (perf record, cpu-clock, every thread of this process) by SYMBOLS bucket -> per call
    {bucket: microseconds}, each bucket's share of the call's samples times the call's own wall time (the buckets
    sum to it), and each call's seconds."""
    data = folder / "perf.data"
    command = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "2000", "-g", "-k", "CLOCK_MONOTONIC"]
    try:
        recorder = subprocess.Popen([*command, "-p", str(os.getpid()), "-o", str(data)], stderr=subprocess.PIPE)
    except OSError as error:
        raise errors.UsageError(
            f"ExecuTorch without ETDump is sampled with perf, which does not run: {error}"
        ) from None
    time.sleep(1.0)  # perf attaches
    windows = []
    for method, inputs in calls:
        if beside is not None:  # the unprofiled twin, outside the windows
            beside(method, inputs)
        start = time.clock_gettime(time.CLOCK_MONOTONIC)
        session.run(method, inputs)
        windows.append((start, time.clock_gettime(time.CLOCK_MONOTONIC)))
    recorder.send_signal(signal.SIGINT)
    _, problem = recorder.communicate(timeout=120)
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "time,ip,sym,dso", "--no-inline"], capture_output=True, text=True
    )
    if script.returncode != 0 or not data.is_file():
        raise errors.UsageError(f"perf recorded nothing: {(problem or b'').decode()[:200]} {script.stderr[:200]}")
    samples = _samples(script.stdout)
    index, counts = 0, [{} for _ in windows]
    for stamp, frames in samples:
        while index < len(windows) and stamp > windows[index][1]:
            index += 1
        if index == len(windows):
            break
        if stamp >= windows[index][0]:
            bucket = symbol_bucket(frames)
            counts[index][bucket] = counts[index].get(bucket, 0) + 1
    out = [
        {b: 1e6 * (end - start) * n / sum(count.values()) for b, n in count.items()}
        for (start, end), count in zip(windows, counts)
    ]
    return out, [end - start for start, end in windows]


def _samples(text: str) -> list[tuple[float, list[str]]]:
    """perf script's samples -> (monotonic seconds, frames leaf first), in time order."""
    samples: list[tuple[float, list[str]]] = []
    for line in text.splitlines():
        head = re.match(r"^\s*(\d+\.\d+):\s*$", line) or re.match(r"^\s*(\d+\.\d+):", line)
        if head and not line.startswith("\t"):
            samples.append((float(head[1]), []))
        elif samples and line.strip():
            samples[-1][1].append(line.strip().split(" ", 1)[-1])
    return sorted(samples, key=lambda sample: sample[0])
