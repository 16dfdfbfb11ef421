"""The server's /metrics in Prometheus' text format (version 0.0.4), written by hand: no client library.

    streamfuse_requests_total{endpoint,status}         counter    answers by route and HTTP status
    streamfuse_generated_tokens_total                  counter    tokens decoded for requests
    streamfuse_time_to_first_token_seconds             histogram  arrival (queue wait included) to first token
    streamfuse_time_per_output_token_seconds           histogram  each later token: its step's wait / its tokens
    streamfuse_accepted_tokens_per_step                histogram  draft tokens accepted per speculative step
    streamfuse_lanes_busy, streamfuse_queue_depth      gauge      lanes decoding, requests waiting
    streamfuse_plain_steps_total, streamfuse_steps_total counter  batch steps run as plain rows; all steps
    streamfuse_worker_up, streamfuse_worker_restarts_total, streamfuse_worker_faults_total

The worker thread observes while the event loop renders: one lock guards the numbers.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/")


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float, times: int = 1) -> None:
        if not math.isfinite(value) or times < 1:
            return
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += times
                break
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        lines, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {_number(self.sum)}"]
        return [*lines, f"{name}_count {self.count}"]


class Metrics:
    """The numbers behind /metrics: requests (the HTTP guard), tokens and latencies (the scheduler)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(TOKEN_BUCKETS)
        self.accepted = Histogram(ACCEPTED_BUCKETS)

    def request(self, path: str, status: int) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # a bounded label set, whatever paths clients try
        with self.lock:
            self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def step(self, tokens: int, seconds: float, accepted: int | None) -> None:
        """One step of one request: its new tokens, the seconds since its last ones (None on the first step:
        time to first token has it), the draft tokens it accepted (None: not a speculative step)."""
        with self.lock:
            self.tokens += tokens
            if seconds is not None and tokens:
                self.per_token.observe(seconds / tokens, tokens)
            if accepted is not None:
                self.accepted.observe(accepted)

    def render(self, gauges: dict[str, tuple[str, str, float]]) -> str:
        """The text format; gauges: name -> (type, help, value) read from the scheduler at the scrape."""
        with self.lock:
            out = _head("streamfuse_requests_total", "counter", "HTTP answers by endpoint and status")
            out += [
                f'streamfuse_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}'
                for (endpoint, status), count in sorted(self.requests.items())
            ]
            out += _head("streamfuse_generated_tokens_total", "counter", "tokens decoded for requests")
            out.append(f"streamfuse_generated_tokens_total {self.tokens}")
            for name, help_text, histogram in (
                ("streamfuse_time_to_first_token_seconds", "arrival to first token, queue wait included", self.ttft),
                ("streamfuse_time_per_output_token_seconds", "seconds per token after the first", self.per_token),
                ("streamfuse_accepted_tokens_per_step", "draft tokens accepted per speculative step", self.accepted),
            ):
                out += _head(name, "histogram", help_text) + histogram.lines(name)
        for name, (kind, help_text, value) in gauges.items():
            out += [*_head(name, kind, help_text), f"{name} {_number(value)}"]
        return "\n".join(out) + "\n"


def _head(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
