"""The decode loop of every method: prefill, then draft -> verify in one target call -> commit.

    prefill(prompt) -> root = the target's token; drafter.start
    loop: draft = drafter.propose(root)           (plain decoding: the root alone)
          step(draft) -> accept a path -> commit its K/V -> drafter.observe
          -> emit the accepted drafts + the correction, which becomes the next root
One target call per step; a drafter's own calls (a draft model's) are counted beside them. The
drafters (runtime/request/drafter.py) differ in what they propose; acceptance, the commit, stop rules,
the fallback (plain steps while speculation does not pay, runtime/speculation/fallback.py) and the trace are
this loop's, so every method emits what plain decoding would.

A `Generation` is one sequence's loop unrolled into its steps (begin, start, then propose -> target
call -> finish until done), so a batch (runtime/request/batch.py) can make one call for several sequences'
steps and a conversation can start a generation over the cache its last one left (`keep`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from streamfuse.runtime.backends.base import Backend, EngineError, StepOutput
from streamfuse.runtime.methods import registry
from streamfuse.runtime.request.checks import check_fits
from streamfuse.runtime.request.drafter import Draft, Drafter, top_chain
from streamfuse.runtime.request.emitter import Emitter
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import RunRecord, StepRecord, Switch, Trace
from streamfuse.runtime.speculation.accept import Acceptance, accept, accept_sampled
from streamfuse.runtime.speculation.fallback import Fallback
from streamfuse.runtime.speculation.sampling import SamplingConfig, choose, target_probs
from streamfuse.runtime.speculation.tree import TreeSpec

ROOT_ONLY = TreeSpec(())  # a plain step's shape for acceptance: no drafts below the root


@dataclass(frozen=True)
class StepEvent:
    tokens: list[int]  # newly emitted tokens (accepted drafts, then the correction)
    accepted_drafts: int  # how many of them came from the draft
    drafted: list[int]  # the tokens of the draft's top-1 chain that was verified
    plain: bool = False  # a plain decoding step of a speculative run (its fallback had switched speculation off)


@dataclass
class GenerationResult:
    token_ids: list[int]
    stop_reason: str
    run: RunRecord


@dataclass(frozen=True)
class PlannedStep:
    """What the next target call verifies: the draft, whether the call runs the streams, and whether the run
    speculates this step (its fallback may have switched to plain steps, or a batch held it to a plain step)."""

    draft: Draft
    streams: bool
    speculating: bool
    drafted: float  # seconds the drafter took
    plain_rows: bool = (
        False  # a plain step the caller asked for (propose(plain_rows=True)): the fallback does not count it
    )


def kept_prefix(keep: Sequence[int], prompt_ids: Sequence[int]) -> int:
    """Cache rows a generation keeps: the longest common prefix of what the cache holds and the prompt, less
    the prompt's last token, whose prefill gives the first token's logits."""
    limit = min(len(keep), len(prompt_ids) - 1)
    length = 0
    while length < limit and int(keep[length]) == int(prompt_ids[length]):
        length += 1
    return length


def start_cache(backend: Backend, keep: Sequence[int] | None, prompt_ids: Sequence[int], capacity: int) -> int:
    """Make the backend's cache ready for the prompt -> the rows kept. A backend whose last call failed holds an
    unknown cache: it starts empty, as without `keep`."""
    if keep is not None:
        kept = kept_prefix(keep, prompt_ids)
        try:
            backend.rollback(kept)
        except EngineError:
            pass
        else:
            backend.reserve(capacity)
            return kept
    backend.reset(capacity)
    return 0


@dataclass
class DecodeRun:
    """What one generation carries through its loop (speculative or plain)."""

    backend: Backend
    trace: Trace
    record: RunRecord
    generator: np.random.Generator
    emitter: Emitter
    started: float
    capacity: int  # KV positions the run may touch
    kept: int = 0  # prompt rows the cache held already

    @classmethod
    def begin(
        cls,
        backend: Backend,
        prompt_ids: Sequence[int],
        settings: DecodeSettings,
        drafter: Drafter,
        trace: Trace | None,
        run_id: str,
        detokenizer,
        keep: Sequence[int] | None = None,
        capacity: int | None = None,
    ) -> DecodeRun:
        """Check the prompt and its fit (runtime/request/checks.py's check_fits) unless the caller did and gives the
        `capacity` it granted, then reset the backend (or keep the rows `keep` shares with the prompt); nothing
        runs before the checks pass. The reset is what makes a generation independent of the last one, even one
        that raised mid-step (a pending commit, a failed call: runtime/backends/static_graph.py), whoever calls."""
        if capacity is None:
            capacity = check_fits(backend, prompt_ids, settings.rules, drafter.tree)
        trace = trace or Trace(enabled=False)
        run = cls(
            backend,
            trace,
            trace.start_run(run_id, len(prompt_ids), drafter.name),
            np.random.default_rng(settings.seed),
            Emitter(settings.rules, detokenizer),
            time.perf_counter(),
            capacity,
        )
        run.kept = start_cache(backend, keep, prompt_ids, capacity)
        return run

    def span(self, name: str):
        return self.trace.span(self.record, name)

    def finish(self) -> GenerationResult:
        record, emitter = self.record, self.emitter
        record.seconds = time.perf_counter() - self.started
        record.new_tokens = len(emitter.tokens)
        record.stop_reason = emitter.stop_reason
        record.peak_memory_bytes = self.backend.peak_memory_bytes()
        return GenerationResult(emitter.tokens, emitter.stop_reason, record)


class Generation:
    """One sequence's decode, advanced a step at a time: `start` (the prefill), then `step` until `done`, or
    `propose` -> a target call made elsewhere (one batched call for several sequences) -> `finish`.
    `cached_ids` are the token ids the backend's cache holds, in order: the prompt, then each step's committed
    path (its root and accepted drafts, also those the stop rules cut off), which a next generation on the same
    backend passes as `keep`."""

    def __init__(self, run: DecodeRun, drafter: Drafter, settings: DecodeSettings, prompt_ids: Sequence[int]):
        self.run, self.drafter, self.settings = run, drafter, settings
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.verify = Verifier(settings.sampling, run.generator)
        self.cached_ids: list[int] = self.prompt_ids[: run.kept]
        self.prefilled = 0
        self.root: int | None = None
        use_switch = settings.fallback is not None and drafter.tree is not None
        self.switch = Fallback(settings.fallback) if use_switch else None

    @classmethod
    def begin(
        cls,
        backend: Backend,
        prompt_ids: Sequence[int],
        settings: DecodeSettings,
        drafter: Drafter | None = None,
        trace: Trace | None = None,
        run_id: str = "0",
        detokenizer: Callable[[Sequence[int]], str] | None = None,
        keep: Sequence[int] | None = None,
        capacity: int | None = None,
    ) -> Generation:
        """Check the request and ready the backend's cache (see DecodeRun.begin; `capacity`: the caller checked
        the prompt's fit, runtime/request/checks.py's check_fits); drafter None: the method's engine_drafter."""
        drafter = drafter or engine_drafter(settings, backend)
        if drafter.name != settings.method:
            raise ValueError(f"settings ask for method {settings.method!r} but the drafter is {drafter.name!r}")
        run = DecodeRun.begin(backend, prompt_ids, settings, drafter, trace, run_id, detokenizer, keep, capacity)
        return cls(run, drafter, settings, prompt_ids)

    @property
    def backend(self) -> Backend:
        return self.run.backend

    @property
    def done(self) -> bool:
        return self.run.emitter.done

    def start(self, on_step: Callable[[StepEvent], None] | None = None) -> None:
        """Prefill the prompt's tokens past the kept rows, start the drafter, emit the first token (the root)."""
        run, drafter = self.run, self.drafter
        new = self.prompt_ids[run.kept :]
        with run.span("prefill"):
            out = self.backend.prefill(new, with_streams=drafter.uses_streams)
            self.root = self.verify.choose(out.main_logits[0])
        self.prefilled = len(new)
        self.cached_ids = list(self.prompt_ids)
        with run.span("draft"):
            run.record.draft_calls = drafter.start(self.prompt_ids, out, self.root, run.capacity)
        run.record.model_calls = 1
        notify(on_step, run.emitter.emit([self.root]), 0, [])

    def propose(self, plain_rows: bool = False) -> PlannedStep:
        """The next step's draft: the drafter's, or the root alone while the fallback has speculation off or
        `plain_rows` asks for a plain step (a batch where plain rows are cheaper; the drafter keeps its last
        streams)."""
        switch, drafter = self.switch, self.drafter
        speculating = switch is None or switch.speculating
        if plain_rows and speculating and drafter.tree is not None:
            return PlannedStep(Draft.plain(self.root), False, False, 0.0, plain_rows=True)
        started = time.perf_counter()
        with self.run.span("draft"):
            draft = drafter.propose(self.root) if speculating else Draft.plain(self.root)
        streams = drafter.uses_streams and (speculating or switch.last_plain_token)
        return PlannedStep(draft, streams, speculating, time.perf_counter() - started)

    def forward(self, planned: PlannedStep) -> StepOutput:
        """The target call that verifies `planned` on this generation's backend."""
        draft = planned.draft
        with self.run.span("forward"):
            return self.backend.step(
                draft.tokens,
                draft.tree,
                with_streams=planned.streams,
                prune=self.settings.prune if draft.speculative else None,
                greedy=self.verify.greedy,
            )

    def finish(self, planned: PlannedStep, out: StepOutput, on_step: Callable[[StepEvent], None] | None = None):
        """After the target call: accept, commit, let the drafter observe, emit; the correction is the next root."""
        run, drafter, draft = self.run, self.drafter, planned.draft
        with run.span("accept"):
            result = self.verify(draft, out)
        with run.span("cache"):
            self.backend.commit(result.path)
        self.cached_ids.extend(draft.tokens[n] for n in result.path)
        with run.span("streams"):
            drafter.observe(draft, out, result.path, result.correction)
        with run.span("host"):
            accepted = [draft.tokens[n] for n in result.path[1:]]
            emitted = run.emitter.emit(accepted + [result.correction])
        _record(run.record, draft, out, result, planned.drafted)
        if on_step is not None and draft.speculative:  # the top-1 chain is only for the callback, not the hot path
            notify(on_step, emitted, min(len(accepted), len(emitted)), top_chain(draft.tree, draft.tokens))
        else:
            notify(on_step, emitted, 0, [], plain=drafter.tree is not None)
        self.root = result.correction
        if self.switch is not None and not planned.plain_rows:
            _fallback(run, self.switch, planned.speculating, len(result.path), draft.tree)

    def step(self, on_step: Callable[[StepEvent], None] | None = None) -> None:
        """One step on this generation's own backend: propose, one target call, finish."""
        planned = self.propose()
        self.finish(planned, self.forward(planned), on_step)

    def result(self) -> GenerationResult:
        return self.run.finish()


def generate(
    backend: Backend,
    prompt_ids: Sequence[int],
    settings: DecodeSettings,
    *,
    drafter: Drafter | None = None,
    trace: Trace | None = None,
    run_id: str = "0",
    on_step: Callable[[StepEvent], None] | None = None,
    detokenizer: Callable[[Sequence[int]], str] | None = None,
    keep: Sequence[int] | None = None,
) -> GenerationResult:
    """Decode with settings.method's drafter (one built from the engine alone, the method's engine_drafter, unless
    given; a method with a model of its own is given its drafter). detokenizer: token ids -> text, for stop strings.
    keep: what the backend's cache holds from its last generation (that one's Generation.cached_ids), whose
    prefix shared with the prompt is not prefilled again."""
    generation = Generation.begin(backend, prompt_ids, settings, drafter, trace, run_id, detokenizer, keep)
    generation.start(on_step)
    while not generation.done:
        generation.step(on_step)
    return generation.result()


def engine_drafter(settings: DecodeSettings, backend: Backend) -> Drafter:
    """settings.method's drafter from the target's engine alone (Method.engine_drafter)."""
    make = registry.get(settings.method).engine_drafter
    if make is not None:
        return make(settings, backend)
    raise ValueError(
        f"method {settings.method!r} drafts with its own model: pass its drafter (the artifact's "
        f"Loaded.drafter(settings))"
    )


def _record(record: RunRecord, draft: Draft, out: StepOutput, result: Acceptance, drafted: float) -> None:
    record.model_calls += 1
    if not draft.speculative:
        record.plain_calls += 1
        return
    tree = draft.tree
    kept = sum(out.kept) if out.kept is not None else tree.num_nodes
    from_lookup = len(set(result.path) & set(tree.lookup_nodes[: draft.from_lookup]))
    record.draft_calls += draft.calls
    record.steps.append(
        StepRecord(tree.num_nodes, kept, len(result.path) - 1, len(result.path), from_lookup, draft.calls, drafted)
    )


def _fallback(run: DecodeRun, switch: Fallback, speculating: bool, tokens: int, tree: TreeSpec | None) -> None:
    """Tell the switch how the step went (at its tree's cost); record its switches in the trace."""
    if not speculating:
        if switch.after_plain_token():
            run.record.switches.append(Switch(len(run.emitter.tokens), run.record.method))
        return
    rate = switch.after_step(tokens, switch.config.cost(tree.paths))
    if rate is not None:
        run.record.switches.append(Switch(len(run.emitter.tokens), "plain", round(rate, 3)))


@dataclass
class Verifier:
    """The target's side of acceptance: its token choice and the rule for the draft's kind."""

    sampling: SamplingConfig
    generator: np.random.Generator

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def choose(self, logits: np.ndarray) -> int:
        return choose(logits, self.sampling, self.generator)

    def __call__(self, draft: Draft, out: StepOutput) -> Acceptance:
        tree = draft.tree or ROOT_ONLY
        if draft.probs is None or self.greedy:
            return accept(tree, draft.tokens, lambda n: out.next_token(n, self.choose), out.kept)
        return accept_sampled(
            tree, draft.tokens, draft.probs, lambda n: target_probs(out.main_logits[n], self.sampling), self.generator
        )


def notify(on_step, tokens: list[int], accepted: int, drafted: list[int], plain: bool = False) -> None:
    if on_step is not None and tokens:
        on_step(StepEvent(tokens, accepted, drafted, plain))
