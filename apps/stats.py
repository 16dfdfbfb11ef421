"""Live figures of one generation: tokens/s, model calls, call reduction, mean accepted length.

Definitions match the README and runtime/measure/trace_profile.py: CR = new tokens / model calls with the
prefill counted as a call (plain decoding: CR = 1); mean accepted length = accepted draft
tokens per verify step (the profiler's mean_accepted_depth; the correction token not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamfuse.runtime.request.completion import Completion
from streamfuse.runtime.request.decode import StepEvent

STOP_LABELS = {"max_new_tokens": "max tokens", "stop_string": "stop string"}


@dataclass
class RunStats:
    method: str
    new_tokens: int = 0
    model_calls: int = 0  # one step event per model call, the prefill included
    verify_steps: int = 0  # calls that checked a draft
    accepted_drafts: int = 0
    plain_steps: int = 0  # SS: steps decoded plainly while the fallback had switched speculation off
    switches: int = 0  # SS: times the fallback switched between speculating and plain decoding
    seconds: float = 0.0
    stop_reason: str = ""  # the runtime's ("eos", "max_new_tokens", ...) or "stopped"; "" while running
    _last_plain: bool = field(default=False, repr=False)  # the last event's mode (the prefill's: speculative)

    def add(self, event: StepEvent, seconds: float) -> None:
        self.new_tokens += len(event.tokens)
        self.model_calls += 1
        self.verify_steps += bool(event.drafted)
        self.accepted_drafts += event.accepted_drafts
        self.switches += event.plain != self._last_plain
        self.plain_steps += event.plain
        self._last_plain = event.plain
        self.seconds = seconds

    def finish(self, completion: Completion) -> None:
        """The runtime's own counts and timing replace the live ones."""
        stats = completion.stats
        self.new_tokens, self.model_calls = stats.new_tokens, stats.model_calls
        self.seconds, self.stop_reason = stats.seconds, completion.stop_reason

    @property
    def call_reduction(self) -> float | None:
        return self.new_tokens / self.model_calls if self.model_calls else None

    @property
    def mean_accepted(self) -> float | None:
        return self.accepted_drafts / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None


def stat_fields(stats: RunStats) -> list[tuple[str, str]]:
    """(label, value) pairs for display; '-' where a figure does not exist (yet)."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    started = stats.model_calls > 0
    stop = STOP_LABELS.get(stats.stop_reason, stats.stop_reason) or ("running" if started else "-")
    fallback = f"{stats.plain_steps} plain steps, {stats.switches} switches" if stats.plain_steps else "-"
    return [
        ("tokens", str(stats.new_tokens)),
        ("tokens/s", number(stats.tokens_per_second, 1)),
        ("model calls", str(stats.model_calls)),
        ("CR", number(stats.call_reduction, 2)),
        ("mean accepted", number(stats.mean_accepted, 2)),
        ("fallback", fallback),
        ("time", f"{stats.seconds:.2f} s" if started else "-"),
        ("stop", stop),
    ]


def comparison(left: RunStats, right: RunStats, same_output: bool) -> str:
    """One line comparing two finished runs on the same input (right against left)."""
    parts = [f"{right.method.upper()} vs {left.method.upper()}:"]
    if left.tokens_per_second and right.tokens_per_second:
        parts.append(f"speed {right.tokens_per_second / left.tokens_per_second:.2f}x,")
    parts.append(f"model calls {right.model_calls} vs {left.model_calls},")
    parts.append("same output" if same_output else "outputs differ (expected only when sampling)")
    return " ".join(parts)
