"""Speculative Streaming decoding: prefill, then verify-and-speculate steps.

    prefill(prompt, streams at its last token) -> root = target token, drafts = stream top-k
    loop: step(tree of root + drafts) -> accept a path -> commit its K/V
          -> emit accepted drafts + correction -> drafts from the streams of the last accepted node
One model call per step; the correction token becomes the next tree's root. With a fallback
(runtime/fallback.py) the loop decodes the root plainly while speculation does not pay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from streamfuse.runtime.accept import accept
from streamfuse.runtime.backends.base import Backend, PruneConfig
from streamfuse.runtime.emitter import Emitter, StopRules
from streamfuse.runtime.fallback import Fallback
from streamfuse.runtime.lookup import PromptLookup
from streamfuse.runtime.sampling import choose
from streamfuse.runtime.settings import DecodeSettings
from streamfuse.runtime.trace import RunRecord, StepRecord, Switch, Trace
from streamfuse.runtime.tree import TreeSpec


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


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def required_capacity(prompt_len: int, rules: StopRules, tree: TreeSpec | None, max_positions: int) -> int:
    """KV positions a run can touch: prompt, every emitted token, and one step's scratch rows.
    Checked before any work, so a run never stops half-way for lack of context."""
    needed = prompt_len + rules.max_new_tokens + (tree.num_nodes if tree else 1)
    if needed > max_positions:
        raise ValueError(f"prompt of {prompt_len} tokens + max_new_tokens {rules.max_new_tokens} + draft tree "
                         f"{tree.num_nodes if tree else 1} exceeds the model's context of {max_positions} positions; "
                         f"shorten the prompt or lower max_new_tokens")
    return needed


def draft_tokens(tree: TreeSpec, root: int, ranked: torch.Tensor, looked_up: Sequence[int] = ()) -> tuple[list[int], int]:
    """Fill the tree: node at depth d with rank r takes stream d's r-th most likely token.
    ranked: [gamma, K] token ids of each stream, best first (K >= the tree's widest level).
    looked_up: prompt-lookup tokens for the tree's lookup branch, shallowest first.
    Returns the node tokens and how many lookup-branch nodes (from the top) took lookup tokens."""
    top = ranked.tolist()
    tokens = [root] + [top[depth - 1][rank] for depth, rank in zip(tree.depths[1:], tree.ranks[1:])]
    return tokens, _fill_lookup(tree, tokens, looked_up)


def _fill_lookup(tree: TreeSpec, tokens: list[int], looked_up: Sequence[int]) -> int:
    """Put lookup tokens on the lookup branch (in place), stopping at the first that repeats a
    sibling's token: acceptance takes the first matching child, so siblings must stay distinct
    (and a repeated sibling adds nothing). Below that point the branch keeps its stream tokens."""
    filled = 0
    for node, token in zip(tree.lookup_nodes, looked_up):
        siblings = tree.children[tree.parents[node]]
        if any(tokens[s] == token for s in siblings if s != node):
            break
        tokens[node] = token
        filled += 1
    return filled


@dataclass
class DecodeRun:
    """What one generation carries through its loop (speculative or plain)."""

    backend: Backend
    trace: Trace
    record: RunRecord
    generator: torch.Generator
    emitter: Emitter
    started: float

    @classmethod
    def begin(cls, backend: Backend, prompt_ids: Sequence[int], rules: StopRules, tree: TreeSpec | None,
              trace: Trace | None, run_id: str, decode, seed: int) -> "DecodeRun":
        """Validate the request, then reset the backend; nothing runs before the checks pass."""
        check_prompt(prompt_ids, backend.vocab_size)
        capacity = required_capacity(len(prompt_ids), rules, tree, backend.max_positions)
        trace = trace or Trace(enabled=False)
        run = cls(backend, trace, trace.start_run(run_id, len(prompt_ids)), torch.Generator().manual_seed(seed),
                  Emitter(rules, decode), time.perf_counter())
        backend.reset(capacity)
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


def generate_speculative(
    backend: Backend,
    prompt_ids: Sequence[int],
    settings: DecodeSettings,
    *,
    trace: Trace | None = None,
    run_id: str = "0",
    on_step: Callable[[StepEvent], None] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> GenerationResult:
    """settings.tree drafts; settings.fallback switches to plain decoding while speculation does not
    pay (runtime/fallback.py). decode: token ids -> text, for stop strings."""
    tree, sampling, fallback = settings.tree, settings.sampling, settings.fallback
    tree.check_streams(backend.num_streams)
    run = DecodeRun.begin(backend, prompt_ids, settings.rules, tree, trace, run_id, decode, settings.seed)
    target = lambda logits: choose(logits, sampling, run.generator)  # noqa: E731
    width = max(tree.widths)
    with run.span("prefill"):
        out = backend.prefill(prompt_ids, with_streams=True)
        root = target(out.main_logits[0])
        streams = out.stream_top(0, width)
    run.record.model_calls = 1
    notify(on_step, run.emitter.emit([root]), 0, [])
    lookup = PromptLookup([*prompt_ids, root]) if tree.lookup else None
    switch = Fallback(fallback) if fallback is not None else None
    speculate = Speculation(run, tree, target, settings.prune, sampling.greedy, lookup)
    while not run.emitter.done:
        if switch is not None and not switch.speculating:
            root, fresh = plain_token(run, root, target, width if switch.last_plain_token else 0, lookup, on_step)
            if switch.after_plain_token():
                streams = fresh
                run.record.switches.append(Switch(len(run.emitter.tokens), "ss"))
            continue
        root, streams, tokens = speculate(root, streams, width, on_step)
        rate = switch.after_step(tokens) if switch is not None else None
        if rate is not None:
            run.record.switches.append(Switch(len(run.emitter.tokens), "plain", round(rate, 3)))
    return run.finish()


@dataclass
class Speculation:
    """One verify-and-speculate step: draft the tree, one model call, accept, commit, next drafts."""

    run: DecodeRun
    tree: TreeSpec
    target: Callable[[torch.Tensor], int]
    prune: PruneConfig | None
    greedy: bool
    lookup: PromptLookup | None

    def __call__(self, root: int, streams: torch.Tensor, width: int, on_step) -> tuple[int, torch.Tensor, int]:
        """Returns the next root, the next drafts and how many tokens the step emitted (or would have: the
        emitter may stop early)."""
        run, tree, backend, lookup = self.run, self.tree, self.run.backend, self.lookup
        with run.span("host"):
            tokens, filled = draft_tokens(tree, root, streams, lookup.draft(len(tree.lookup)) if lookup else ())
        with run.span("forward"):
            out = backend.step(tokens, tree, with_streams=True, prune=self.prune, greedy=self.greedy)
        with run.span("accept"):
            result = accept(tree, tokens, lambda n: out.next_token(n, self.target), out.kept)
        with run.span("cache"):
            backend.commit(result.path)
        with run.span("streams"):
            streams = out.stream_top(result.path[-1], width)
        with run.span("host"):
            drafts = [tokens[n] for n in result.path[1:]]
            emitted = run.emitter.emit(drafts + [result.correction])
            if lookup is not None:
                lookup.extend(drafts + [result.correction])
        run.record.model_calls += 1
        kept = sum(out.kept) if out.kept is not None else tree.num_nodes
        from_lookup = len(set(result.path) & set(tree.lookup_nodes[:filled]))
        run.record.steps.append(StepRecord(tree.num_nodes, kept, len(result.path) - 1, len(result.path), from_lookup))
        if on_step is not None:  # the top-1 chain is only for the callback, not the hot path
            notify(on_step, emitted, min(len(drafts), len(emitted)), _top_chain(tree, tokens))
        return result.correction, streams, len(result.path)


def plain_token(run: DecodeRun, root: int, target, width: int, lookup: PromptLookup | None,
                on_step) -> tuple[int, torch.Tensor | None]:
    """One plain decoding step inside a speculative run (the fallback): feeds the root, emits the next
    token. width > 0 also returns the new root's drafts (for the probe that follows)."""
    backend = run.backend
    with run.span("forward"):
        out = backend.step([root], None, with_streams=width > 0)
    with run.span("accept"):
        token = target(out.main_logits[0])
    with run.span("cache"):
        backend.commit([0])
    streams = None
    if width:
        with run.span("streams"):
            streams = out.stream_top(0, width)
    with run.span("host"):
        emitted = run.emitter.emit([token])
        if lookup is not None:
            lookup.extend([token])
    run.record.model_calls += 1
    run.record.plain_calls += 1
    notify(on_step, emitted, 0, [], plain=True)
    return token, streams


def _top_chain(tree: TreeSpec, tokens: Sequence[int]) -> list[int]:
    """Tokens of the all-rank-0 path below the root (what a chain draft would have proposed)."""
    chain, node = [], 0
    while True:
        child = next((c for c in tree.children[node] if tree.ranks[c] == 0), None)
        if child is None:
            return chain
        chain.append(tokens[child])
        node = child


def notify(on_step, tokens: list[int], accepted: int, drafted: list[int], plain: bool = False) -> None:
    if on_step is not None and tokens:
        on_step(StepEvent(tokens, accepted, drafted, plain))
