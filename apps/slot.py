"""A request's life in the server, in one object, a ServerSlot: the runtime's Slot (runtime/request/slot.py: its
state, lane, detokenizer, time to first token and Completion, as Model.run's) with what the server adds: its
deadline, cache tag, metrics and the queue its HTTP handler reads.

The worker thread (apps/scheduler.py) moves it and calls its step callback; the slot detokenizes a streamed
request's tokens there (off the event loop), and hands the HTTP handler events through an asyncio queue: Delta
(streamed text, with the step's tokens when asked), then Finished or Failed. The handler only translates those to
HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from streamfuse.apps.server_metrics import Metrics
from streamfuse.runtime.request.completion import Completion
from streamfuse.runtime.request.decode import StepEvent
from streamfuse.runtime.request.lifecycle import State
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.slot import Slot


class InjectedFault(RuntimeError):
    """A fault a request asked for (serve --fault-injection): the load test's worker fault."""


@dataclass(frozen=True)
class Step:
    """One step of a streamed request as the page shows it: each new token's text and whether it was an accepted
    draft token, the drafted tokens thrown away, and whether it was a plain step."""

    number: int
    pieces: tuple[tuple[str, bool], ...]
    rejected: int
    plain: bool

    def json(self) -> dict:
        pieces = [{"text": text, "draft": draft} for text, draft in self.pieces]
        return {"step": self.number, "pieces": pieces, "rejected": self.rejected, "plain": self.plain}


@dataclass(frozen=True)
class Delta:
    """New text of a streamed request (its step with it when the request asked for steps)."""

    text: str
    step: Step | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of a request that ended well: its Completion and the text its stream held to the end."""

    completion: Completion
    rest: str = ""


@dataclass(frozen=True)
class Failed:
    """The last event of a request that did not: one line for the client, and the HTTP status it maps to."""

    message: str
    status: int = 500
    kind: str = "server_error"


Event = Delta | Finished | Failed


@dataclass(eq=False)
class ServerSlot(Slot):
    """One request as the server holds it: the runtime's slot (its state, lane, detokenizer, time to first token,
    Completion), the queue its handler reads and what HTTP asks of it."""

    loop: asyncio.AbstractEventLoop | None
    stream: bool = False
    steps: bool = False  # streamed Deltas carry their Step
    tag: object = None  # cache isolation: whose cached prefix it may keep (apps/scheduler.py)
    timeout: float = 600.0  # seconds from arrival to its deadline
    fault_after: int | None = None  # raise InjectedFault after this many steps (serve --fault-injection)
    capacity: int | None = (
        None  # KV positions its parse granted (runtime/request/checks.py's check_fits); None: check it
    )
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set from the event loop, read by the worker: a plain flag is enough
    metrics: Metrics | None = None
    _count: int = 0  # steps so far
    _last: float = 0.0  # when its last tokens came

    @property
    def deadline(self) -> float:
        return self.arrived + self.timeout

    def push(self, event: Event) -> None:
        """Hand an event to the handler's event loop (from the worker thread)."""
        if self.loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for the event
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def on_step(self, event: StepEvent) -> None:
        """The decoder's callback (the worker thread): time the tokens, detokenize a stream's, push them."""
        if self.cancelled:
            return
        super().on_step(event)  # its first token: decoding, and its time
        now, self._count = time.monotonic(), self._count + 1
        if self.metrics is not None:
            speculative = bool(event.drafted) and not event.plain
            waited = None if self._count == 1 else now - self._last
            self.metrics.step(len(event.tokens), waited, event.accepted_drafts if speculative else None)
            if self._count == 1:
                self.metrics.first_token(self.first_token)
        self._last = now
        if self.fault_after is not None and self._count > self.fault_after:
            raise InjectedFault(f"a fault injected after step {self.fault_after} (serve --fault-injection)")
        if self.stream and self.detokenizer is not None:
            self.push(self._delta(event))

    def _delta(self, event: StepEvent) -> Delta:
        if not self.steps:
            return Delta(self.detokenizer.push(event.tokens))
        pieces = tuple(
            (self.detokenizer.push([token]), index < event.accepted_drafts) for index, token in enumerate(event.tokens)
        )
        rejected = max(0, len(event.drafted) - event.accepted_drafts)
        return Delta("".join(text for text, _ in pieces), Step(self._count, pieces, rejected, event.plain))

    def finish(self, loaded: Loaded) -> Completion:
        """Done: its Completion (the runtime slot's), then the rest of its stream's text, to the handler."""
        completion = super().finish(loaded)
        rest = self.detokenizer.finish() if self.detokenizer is not None else ""
        self.push(Finished(completion, rest))
        return completion

    def fail(self, message: str, status: int = 500, kind: str = "server_error") -> None:
        if self.ended:
            return
        self.state = State.FAILED
        self.push(Failed(" ".join(message.split()), status, kind))
