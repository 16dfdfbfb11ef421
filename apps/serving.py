"""The server's scheduler: one worker thread owns the batch decoder and advances every admitted request together.

    HTTP handler --submit(job)--> bounded queue --worker--> BatchDecoder.add / step / cancel
         ^                                                      |
         +---- job.events (asyncio.Queue, call_soon_threadsafe) <+  tokens of each step, then the result

One thread owns the decoder, so the engines see one caller and requests share each step; the handlers only wait on
their job's events. A full queue refuses a request at once (QueueFull: the server's 503); a cancelled job (its
client went away) leaves its lane before the next step, so its cache serves the next request. With nothing to do
the worker blocks on the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from streamfuse.methods import registry
from streamfuse.runtime.api import Completion, completion_of
from streamfuse.runtime.batch import BatchDecoder
from streamfuse.runtime.decode import StepEvent, required_capacity
from streamfuse.runtime.loader import Loaded
from streamfuse.runtime.settings import DecodeSettings


class QueueFull(Exception):
    """The admission queue holds its maximum of waiting requests."""


@dataclass(frozen=True)
class Tokens:
    """New tokens of one step of a job."""

    ids: list[int]


@dataclass(frozen=True)
class Finished:
    """A job's last event: its generation as the API reports it (text, token ids, stop reason, stats)."""

    completion: Completion


@dataclass(frozen=True)
class Failed:
    """A job's last event when its decode raised: the error, for the handler to report."""

    error: Exception


Event = Tokens | Finished | Failed


@dataclass
class Job:
    """One request in the scheduler: its prompt and settings, and the asyncio queue its handler reads."""

    ids: list[int]
    settings: DecodeSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # set by the handler's thread, read by the worker: a plain flag is enough
    id: str = ""

    def push(self, event: Event) -> None:
        """Hand an event to the handler's event loop (from the worker thread)."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for the event
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def check_fits(loaded: Loaded, ids: Sequence[int], settings: DecodeSettings) -> None:
    """ValueError (one line) unless the prompt plus settings' max_new_tokens fit the model's context: what the
    handler refuses with a 400 before the request waits in the queue."""
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    backend = loaded.backend
    tree = settings.tree if registry.get(settings.method).speculative else None  # a plain step: one row
    required_capacity(len(ids), settings.rules, backend.step_rows(tree), backend.max_positions)


class Scheduler:
    """Admits jobs into lanes of one decoder and steps them together on a worker thread."""

    def __init__(self, loaded: Loaded, max_sequences: int = 8, queue_size: int = 64, hold: bool = True):
        if max_sequences < 1 or queue_size < 1:
            raise ValueError(f"need max_sequences >= 1 and queue >= 1, got {max_sequences} and {queue_size}")
        self.loaded = loaded
        self.max_sequences = max_sequences
        self.waiting: queue.Queue[Job | None] = queue.Queue(queue_size)
        self.decoder = BatchDecoder(loaded, max_sequences, hold)
        self.jobs: dict[str, Job] = {}  # lane id -> its job
        self.counter = itertools.count()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.dropped = 0  # lanes freed before their end because their client went away

    @property
    def active(self) -> int:
        """Lanes decoding now."""
        return len(self.jobs)

    @property
    def queued(self) -> int:
        return self.waiting.qsize()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._work, name="streamfuse-scheduler", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop the worker after its current step; jobs left get a Failed event."""
        self.closed = True
        with contextlib.suppress(queue.Full):
            self.waiting.put_nowait(None)
        if self.thread is not None:
            self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull at once when the queue holds its maximum."""
        if self.closed:
            raise QueueFull("the server is shutting down")
        job.id = str(next(self.counter))
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server's queue holds its maximum of {self.waiting.maxsize} requests") from None

    @staticmethod
    def cancel(job: Job) -> None:
        """Drop a job (its client went away): its lane is freed before the next step."""
        job.cancelled = True

    # --- the worker thread ---

    def _work(self) -> None:
        while not self.closed:
            if not self.jobs and not self._admit(block=True):
                continue
            self._admit(block=False)
            self._drop_cancelled()
            if self.jobs:
                self._step()
        stopped = RuntimeError("the server is shutting down")
        self._fail_all(stopped)
        while True:  # the jobs still waiting
            try:
                job = self.waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.push(Failed(stopped))

    def _admit(self, block: bool) -> bool:
        """Move queued jobs into free lanes (block: wait for the first); False when none was admitted."""
        admitted = False
        while len(self.jobs) < self.max_sequences:
            try:
                job = self.waiting.get(block=block and not admitted)
            except queue.Empty:
                break
            if job is None:  # close()'s wake-up
                break
            admitted |= self._add(job)
        return admitted

    def _add(self, job: Job) -> bool:
        if job.cancelled:
            return False
        try:
            lane = self.decoder.add(job.ids, job.settings, on_step=_pusher(job), run_id=job.id)
        except Exception as error:  # a request the decoder refuses fails alone
            job.push(Failed(error))
            return False
        self.jobs[lane.id] = job
        return True

    def _drop_cancelled(self) -> None:
        for lane in list(self.decoder.active):
            job = self.jobs.get(lane.id)
            if job is not None and job.cancelled:
                self.decoder.cancel(lane)
                del self.jobs[lane.id]
                self.dropped += 1

    def _step(self) -> None:
        try:
            finished = self.decoder.step()
        except Exception as error:  # an engine failure fails the lanes of this step, not the server
            self._fail_all(error)  # each lane's next generation starts from a reset cache
            return
        for lane in finished:
            job = self.jobs.pop(lane.id, None)
            if job is not None:
                stop = job.settings.rules.stop_strings
                job.push(Finished(completion_of(self.loaded, lane.result, stop, lane.generation, 0.0)))

    def _fail_all(self, error: Exception) -> None:
        for lane in list(self.decoder.active):
            with contextlib.suppress(Exception):
                self.decoder.cancel(lane)
        for job in self.jobs.values():
            job.push(Failed(error))
        self.jobs.clear()


def _pusher(job: Job) -> Callable[[StepEvent], None]:
    def on_step(event: StepEvent) -> None:
        if not job.cancelled:
            job.push(Tokens(list(event.tokens)))

    return on_step
