"""Plain decoding on the same backend and model: the parity oracle and the speed-up baseline."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from streamfuse.runtime.backends.base import Backend
from streamfuse.runtime.decode import DecodeRun, GenerationResult, StepEvent, notify
from streamfuse.runtime.sampling import choose
from streamfuse.runtime.settings import DecodeSettings
from streamfuse.runtime.trace import Trace


def generate_autoregressive(
    backend: Backend,
    prompt_ids: Sequence[int],
    settings: DecodeSettings,
    *,
    trace: Trace | None = None,
    run_id: str = "0",
    on_step: Callable[[StepEvent], None] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> GenerationResult:
    """One model call per token; settings.tree, prune and fallback do not apply."""
    sampling = settings.sampling
    run = DecodeRun.begin(backend, prompt_ids, settings.rules, None, trace, run_id, decode, settings.seed)
    with run.span("prefill"):
        token = choose(backend.prefill(prompt_ids, with_streams=False).main_logits[0], sampling, run.generator)
    run.record.model_calls = 1
    notify(on_step, run.emitter.emit([token]), 0, [])
    while not run.emitter.done:
        with run.span("forward"):
            logits = backend.step([token], None, with_streams=False).main_logits[0]
        with run.span("cache"):
            backend.commit([0])
        with run.span("accept"):
            token = choose(logits, sampling, run.generator)
        with run.span("host"):
            emitted = run.emitter.emit([token])
        run.record.model_calls += 1
        notify(on_step, emitted, 0, [])
    return run.finish()
