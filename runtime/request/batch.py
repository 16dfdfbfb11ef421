"""Several sequences decoded together: each step of a BatchDecoder advances every active sequence by one step of
its own decode loop (runtime/request/decode.py's Generation), in ONE target call where the graphs have a batched step
for the sequences' drafts (runtime/backends/batched_step.py), else one call per sequence; the tokens are the same
either way, each sequence's equal to its single-sequence output (greedy or sampled with its own seed).

    decoder = BatchDecoder(loaded, max_sequences=8)
    lane = decoder.add(prompt_ids, settings, on_step=...)   # checked now; it prefills on the next step
    while decoder.active:
        for finished in decoder.step():
            print(finished.result.token_ids)

Each sequence (a Lane) decodes on a cache of its own (Loaded.with_own_cache: its own KV cache over the shared
graph runner and weights); a finished or cancelled lane's cache serves the next sequence added, which keeps the
rows its prompt shares with what that cache holds (Generation.begin's keep; the free cache sharing the most). With
`plain_rows` (the default) a step of several sequences runs its greedy speculative ones as plain steps while plain rows
make more tokens per second at that batch size (runtime/request/batch_policy.py); the tokens are the same. A sequence's
`tag` says whose prefix a free cache may keep (a server isolating its users' caches: only the same tag's); with
`isolate`, a sequence whose own prefill, draft or step raises ends alone (Lane.error) and the others go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count

from streamfuse.runtime.backends.batched_step import BatchItem, batch_rows, batch_shapes, batched_step
from streamfuse.runtime.request.batch_policy import PlainRowsPolicy
from streamfuse.runtime.request.decode import Generation, GenerationResult, PlannedStep, StepEvent, kept_prefix
from streamfuse.runtime.request.lifecycle import ENDED, State
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.trace import Trace

CANCELLED = "cancelled"  # a cancelled lane's stop reason
FAILED = "error"  # the stop reason of a lane whose own step raised (BatchDecoder isolate)


@dataclass(eq=False)
class Lane:
    """One sequence of a batch: its generation, on its own cache of the model, and where it stands (queued until
    the next step prefills it, then decoding until done; failed: its own work raised; cancelled)."""

    id: str
    generation: Generation
    model: Loaded = field(repr=False)
    on_step: Callable[[StepEvent], None] | None = None
    tag: object = None  # whose sequences may keep this lane's cache rows once it ends (add's tag)
    state: State = State.QUEUED
    error: Exception | None = None  # what failed it: its own prefill, draft or step raised
    _result: GenerationResult | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.state in ENDED

    @property
    def result(self) -> GenerationResult:
        """The sequence's tokens and record, once done (a cancelled one: what it emitted, stop reason cancelled)."""
        if not self.done:
            raise ValueError(f"lane {self.id} is still decoding: read its result once it is done")
        return self._result if self._result is not None else self.close()

    def close(self) -> GenerationResult:
        """Its result, made once when the lane ends (its record's seconds end then, not when first read)."""
        self._result = self.generation.result()
        if self.state in (State.FAILED, State.CANCELLED) and not self.generation.done:
            reason = FAILED if self.state is State.FAILED else CANCELLED
            self._result.stop_reason = self._result.run.stop_reason = reason
        return self._result

    def settle(self) -> None:
        """Done once its generation is (after a prefill or a step that emitted its last token)."""
        if self.state is State.DECODING and self.generation.done:
            self.state = State.DONE


class BatchDecoder:
    """Up to max_sequences sequences advanced together, one step of each per step()."""

    def __init__(
        self,
        loaded: Loaded,
        max_sequences: int = 8,
        plain_rows: bool = True,
        policy: PlainRowsPolicy | None = None,
        isolate: bool = False,
        own_cache: bool = False,
    ):
        """plain_rows: apply a batch policy, `policy` (one that measured this model already) or a new one; isolate: a
        sequence whose own work raises ends alone, its lane among step()'s finished with .error set (else the
        step raises, the lane failed); own_cache: the first sequence decodes on `loaded`'s own cache (a Model's
        one-slot decoder: no second cache), the others on caches of their own."""
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.loaded = loaded
        self.max_sequences = max_sequences
        self.policy = (policy or PlainRowsPolicy()) if plain_rows else None
        self.isolate = isolate
        self.prefill_seconds = 0.0  # spent in new sequences' prefills, all steps together
        self.steps = self.shared_steps = self.plain_steps = 0  # steps; those of 2+ sequences; those run as plain rows
        self.active: list[Lane] = []
        # caches whose sequence ended: the ids they hold (None: unknown after a failure) and their tag
        self._free: list[tuple[Loaded, list[int] | None, object]] = [(loaded, None, None)] if own_cache else []
        self._scratch = None  # the backend whose cache pads a batched call of fewer sequences
        self._ids = count()

    def add(
        self,
        ids: list[int],
        settings: DecodeSettings,
        on_step: Callable[[StepEvent], None] | None = None,
        run_id: str = "0",
        tag: object = None,
        capacity: int | None = None,
        keep: bool = True,
        trace: Trace | None = None,
    ) -> Lane:
        """A new sequence, checked now (ValueError: a bad prompt or settings, or the batch full); it prefills on
        the next step() (or prefill()). tag: it keeps cache rows only of a sequence of the same tag (keep=False:
        none, a fresh prefill). capacity: the KV positions its caller's runtime/request/checks.py check_fits
        granted (the prompt checked there; None: checked here). trace: records its run under run_id."""
        if len(self.active) >= self.max_sequences:
            raise ValueError(
                f"the batch decodes {self.max_sequences} sequences already: wait for one to finish or raise "
                f"max_sequences"
            )
        model, cached = self._cache_for(ids, tag)
        try:
            generation = Generation.begin(
                model.backend,
                ids,
                settings,
                model.drafter(settings),
                trace=trace,
                run_id=run_id,
                detokenizer=self._detokenize,
                keep=cached if keep else None,
                capacity=capacity,
            )
        except BaseException:
            self._free.append((model, None, None))
            raise
        lane = Lane(str(next(self._ids)), generation, model, on_step, tag=tag)
        self.active.append(lane)
        return lane

    def step(self) -> list[Lane]:
        """One step of every active sequence (those added since the last step prefill first) -> the lanes that
        finished, no longer active."""
        self.prefill()
        running = [lane for lane in self.active if not lane.done]
        judged = self.policy is not None and any(map(_may_run_plain, running))
        plain = judged and self.policy.plain_rows(len(running))
        planned: dict[Lane, PlannedStep] = {}
        for lane in running:
            with self._guard([lane]):
                planned[lane] = lane.generation.propose(plain and _may_run_plain(lane))
        self.steps += 1
        self.shared_steps += len(running) > 1
        self.plain_steps += any(step.plain_rows for step in planned.values())
        cached = sum(len(lane.generation.cached_ids) for lane in running) if judged else 0
        started = time.perf_counter()
        for group in self._batches(planned):
            self._advance(group, planned)
        if judged:  # the step's cost and tokens, for the policy's next choice
            tokens = sum(len(lane.generation.cached_ids) for lane in running) - cached
            self.policy.observe(len(running), plain, time.perf_counter() - started, tokens)
        for lane in running:
            lane.settle()
        finished = [lane for lane in self.active if lane.done]
        for lane in finished:
            self._release(lane)
        return finished

    def prefill(self) -> None:
        """Prefill the sequences added since the last step (each emits its first token); step() does it first."""
        started = time.perf_counter()
        for lane in self.active:
            if lane.state is State.QUEUED:
                lane.state = State.PREFILLING
                with self._guard([lane]):
                    lane.generation.start(lane.on_step)
                    lane.state = State.DECODING
                lane.settle()
        self.prefill_seconds += time.perf_counter() - started

    def cancel(self, lane: Lane) -> None:
        """Stop a sequence at once (a failed one: free its cache); its cache serves the next sequence added."""
        if lane in self.active:
            if not lane.done:
                lane.state = State.CANCELLED
            self._release(lane)

    def held_ids(self) -> list[int] | None:
        """The ids a free cache holds (a one-slot decoder's between its sequences; None: none known)."""
        return next((cached for _, cached, _ in self._free if cached is not None), None)

    def forget(self) -> None:
        """Free caches keep no rows for the next sequence (each is reset when used)."""
        self._free = [(model, None, tag) for model, _, tag in self._free]

    def _release(self, lane: Lane) -> None:
        lane.close()
        self.active.remove(lane)
        cached = None if lane.state is State.FAILED else lane.generation.cached_ids  # a failed step: rows unknown
        self._free.append((lane.model, cached, lane.tag))

    @contextmanager
    def _guard(self, lanes: list[Lane]):
        """An exception in the lanes' own work fails those lanes (their .error); with isolate it ends them alone,
        else it ends the step too."""
        try:
            yield
        except Exception as error:
            for lane in lanes:
                lane.error, lane.state = lane.error or error, State.FAILED
            if not self.isolate:
                raise

    def _cache_for(self, ids: list[int], tag: object) -> tuple[Loaded, list[int] | None]:
        """The free cache of the same tag that shares the longest prefix with `ids` (a system prompt, a task's
        instructions: those rows are not prefilled again), else any free cache, reset, else a new cache."""
        if not self._free:
            return self.loaded.with_own_cache(), None
        mine = [index for index, (_, cached, owner) in enumerate(self._free) if cached is not None and owner == tag]
        if not mine:
            return self._free.pop(0)[0], None
        best = max(mine, key=lambda index: kept_prefix(self._free[index][1], ids))
        model, cached, _ = self._free.pop(best)
        return model, cached

    def _detokenize(self, ids) -> str:
        return self.loaded.tokenizer.decode(ids)

    def _batches(self, planned: dict[Lane, PlannedStep]) -> list[list[Lane]]:
        """The lanes grouped into calls: those whose drafts fit a batched step of the same rows share one (as many
        as its largest batch holds), the others one call each."""
        by_rows: dict[int | None, list[Lane]] = {}
        for lane, step in planned.items():
            rows = batch_rows(lane.model.backend, step.draft.tree) if self._batchable(lane, step) else None
            by_rows.setdefault(rows, []).append(lane)
        groups = [[lane] for lane in by_rows.pop(None, [])]
        for rows, lanes in by_rows.items():
            spec = lanes[0].model.backend.spec
            for sequences, _ in batch_shapes(spec, len(lanes), rows):
                groups.append(lanes[:sequences])
                lanes = lanes[sequences:]
            groups.extend([lane] for lane in lanes)
        return groups

    @staticmethod
    def _batchable(lane: Lane, step: PlannedStep) -> bool:
        """A draft a batched step verifies: a tree or a plain step, unpruned (pruning is the torch session's)."""
        return lane.generation.settings.prune is None or not step.draft.speculative

    def _advance(self, group: list[Lane], planned: dict[Lane, PlannedStep]) -> None:
        if len(group) == 1:
            lane = group[0]
            with self._guard(group):
                lane.generation.finish(planned[lane], lane.generation.forward(planned[lane]), lane.on_step)
            return
        backend = group[0].model.backend
        rows = backend.step_rows(planned[group[0]].draft.tree)
        shape = backend.spec.batch(len(group), rows)
        if self._scratch is None:
            self._scratch = backend.with_own_cache()
        items = [
            BatchItem(lane.model.backend, planned[lane].draft.tokens, planned[lane].draft.tree, planned[lane].streams)
            for lane in group
        ]
        outs = []
        with self._guard(group):  # the shared call: its failure is every lane's of the group
            outs = batched_step(items, shape, self._scratch)
        for lane, out in zip(group, outs):
            with self._guard([lane]):
                lane.generation.finish(planned[lane], out, lane.on_step)


def _may_run_plain(lane: Lane) -> bool:
    """A sequence the batch policy may run as plain rows: greedy (a sampled one keeps its seed's draws) and
    speculative."""
    return lane.generation.verify.greedy and lane.generation.drafter.tree is not None
