"""Decode traces: what each generation did, step by step, for the profiler and benchmarks.

Schema "streamfuse.trace/3" (JSON):
    {"schema": "streamfuse.trace/3",
     "meta": {"backend": str, "device": str, "method": str, "num_streams": int,
              "tree": {...TreeSpec.to_dict()} | null, "threads": int, ...free-form...},
     "runs": [{"id": str, "method": str (a registered method), "prompt_tokens": int, "new_tokens": int,
               "model_calls": int, "draft_calls": int, "seconds": float, "stop_reason": str,
               "peak_memory_bytes": int | null, "plain_calls": int,
               "spans": {"prefill": s, "draft": s, "forward": s, "accept": s, "cache": s, "streams": s, "host": s},
               "steps": [{"tree_nodes": int, "kept_nodes": int, "accepted_depth": int,
                          "tokens": int, "lookup_accepted": int, "draft_calls": int, "draft_seconds": float}],
               "switches": [{"at_token": int, "to": "plain"|the run's method, "tokens_per_step": float | null}]}]}
model_calls counts the target's calls with the prefill: plain decoding of n tokens makes n calls
(prefill + n - 1). draft_calls counts a draft model's calls (its prefill included); drafts that come
out of the target's own pass (its streams, heads on its last state) cost none.
steps are the drafted steps only; plain_calls counts the calls that verified the root alone: all
of plain decoding's after the prefill, and those a speculative run made while its fallback had
switched speculation off (runtime/speculation/fallback.py); switches says when: at_token is how many tokens
had been emitted, tokens_per_step the failed block's rate; "to" is "plain", or the run's method when it
went back to speculating.
accepted_depth d means draft nodes at depths 1..d were accepted (stream j drafts depth j);
tokens = d + 1 (the accepted drafts plus the target's correction token).
lookup_accepted: how many of the accepted drafts were prompt-lookup tokens (a lookup branch).
Spans: "draft" is the drafter's proposal (streams: filling the tree; a draft model: its calls);
"streams" the drafter's update after the commit (streams: the stream logits of the last accepted node,
with deferred streams their own pass through the MSA layers; a draft model: its rollback);
"host" is emitting. A disabled Trace costs one attribute check per span.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = "streamfuse.trace/3"
SPANS = ("prefill", "draft", "forward", "accept", "cache", "streams", "host")


@dataclass
class StepRecord:
    tree_nodes: int
    kept_nodes: int
    accepted_depth: int
    tokens: int
    lookup_accepted: int = 0
    draft_calls: int = 0
    draft_seconds: float = 0.0


@dataclass
class Switch:
    at_token: int
    to: str  # "plain" | the run's method (back to speculating)
    tokens_per_step: float | None = None  # the failed block's rate (switches to plain)


@dataclass
class RunRecord:
    id: str
    prompt_tokens: int
    method: str
    new_tokens: int = 0
    model_calls: int = 0
    draft_calls: int = 0
    seconds: float = 0.0
    stop_reason: str = ""
    peak_memory_bytes: int | None = None
    plain_calls: int = 0
    spans: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPANS, 0.0))
    steps: list[StepRecord] = field(default_factory=list)
    switches: list[Switch] = field(default_factory=list)


class Trace:
    """Collects RunRecords; `span(name)` times a phase of the current run."""

    def __init__(self, enabled: bool = True, **meta):
        self.enabled = enabled
        self.meta = meta
        self.runs: list[RunRecord] = []

    def start_run(self, run_id: str, prompt_tokens: int, method: str) -> RunRecord:
        run = RunRecord(run_id, prompt_tokens, method)
        if self.enabled:
            self.runs.append(run)
        return run

    @contextmanager
    def span(self, run: RunRecord, name: str):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            run.spans[name] += time.perf_counter() - start

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "meta": self.meta, "runs": [asdict(run) for run in self.runs]}

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)


def load_trace(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(
            f"{path} is not a {SCHEMA} trace (schema: {data.get('schema')!r}); regenerate it with this streamfuse"
        )
    return data
