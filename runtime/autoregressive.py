"""Plain decoding on the same backend and model: the parity oracle and the speed-up baseline."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from streamfuse.runtime.backends.base import Backend
from streamfuse.runtime.decode import GenerationResult, StepEvent, check_prompt, finish_run, notify, required_capacity
from streamfuse.runtime.emitter import Emitter, StopRules
from streamfuse.runtime.sampling import SamplingConfig, choose
from streamfuse.runtime.trace import Trace


def generate_autoregressive(
    backend: Backend,
    prompt_ids: Sequence[int],
    rules: StopRules,
    sampling: SamplingConfig = SamplingConfig(),
    trace: Trace | None = None,
    run_id: str = "0",
    on_step: Callable[[StepEvent], None] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
    seed: int = 0,
) -> GenerationResult:
    check_prompt(prompt_ids, backend.vocab_size)
    trace = trace or Trace(enabled=False)
    run = trace.start_run(run_id, len(prompt_ids))
    generator = torch.Generator().manual_seed(seed)
    emitter = Emitter(rules, decode)
    started = time.perf_counter()
    backend.reset(required_capacity(len(prompt_ids), rules, None, backend.max_positions))
    with trace.span(run, "prefill"):
        token = choose(backend.prefill(prompt_ids, with_streams=False).main_logits[0], sampling, generator)
    run.model_calls = 1
    notify(on_step, emitter.emit([token]), 0, [])
    while not emitter.done:
        with trace.span(run, "forward"):
            logits = backend.step([token], None, with_streams=False).main_logits[0]
        with trace.span(run, "cache"):
            backend.commit([0])
        with trace.span(run, "accept"):
            token = choose(logits, sampling, generator)
        with trace.span(run, "host"):
            emitted = emitter.emit([token])
        run.model_calls += 1
        notify(on_step, emitted, 0, [])
    return finish_run(run, emitter, backend, started)
