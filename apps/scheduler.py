"""The server's scheduler: one worker thread owns the batch decoder and advances every admitted request together.

    HTTP handler --submit(slot)--> bounded queue --worker--> BatchDecoder.add / step / cancel
         ^                                                      |
         +---- slot.events (asyncio.Queue, call_soon_threadsafe) <+  each step's text, then the result

One thread owns the decoder, so the engines see one caller and requests share each step; the handlers only wait on
their slot's events (apps/slot.py: a request's life in one object). A full queue refuses a request at once
(QueueFull: the server's 503); a cancelled slot (its client went away) leaves its lane before the next step, so
its cache serves the next request; a slot past its deadline fails with a 504.

Supervised: a request whose own prefill, draft or step raises fails alone (the decoder's isolate); any other
fault in a cycle fails that cycle's requests with a 500 each and the worker goes on; a worker thread that dies
(or faults MAX_FAULTS cycles in a row) fails its requests and is replaced by a fresh one on a fresh decoder, up
to max_restarts times; after that the scheduler is down (`down` says why: /health's 503) and refuses new work.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time

from streamfuse.apps.server_metrics import Metrics
from streamfuse.apps.slot import ServerSlot
from streamfuse.runtime.request.batch import BatchDecoder
from streamfuse.runtime.request.lifecycle import State
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.text_stream import Detokenizer

MAX_FAULTS = 3  # cycles in a row that raise before the worker counts as dead
WAKE_SECONDS = 1.0  # an idle worker still wakes this often (deadlines of queued requests, close)


class QueueFull(Exception):
    """The admission queue holds its maximum of waiting requests, or the scheduler takes no more work."""


class Scheduler:
    """Admits slots into lanes of one decoder and steps them together on a supervised worker thread."""

    def __init__(
        self,
        loaded: Loaded,
        max_sequences: int = 8,
        queue_size: int = 64,
        plain_rows: bool = True,
        metrics: Metrics | None = None,
        max_restarts: int = 3,
    ):
        if max_sequences < 1 or queue_size < 1:
            raise ValueError(f"need max_sequences >= 1 and queue >= 1, got {max_sequences} and {queue_size}")
        self.loaded = loaded
        self.max_sequences = max_sequences
        self.plain_rows = plain_rows
        self.metrics = metrics or Metrics()
        self.max_restarts = max_restarts
        self.waiting: queue.Queue[ServerSlot | None] = queue.Queue(queue_size)
        self.decoder = self._new_decoder()
        self.slots: dict[str, ServerSlot] = {}  # lane id -> its slot
        self.counter = itertools.count()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.down: str | None = None  # why no worker serves (None: one does)
        self.dropped = 0  # lanes freed before their end because their client went away
        self.restarts = self.faults = 0
        self.plain_before = self.steps_before = 0  # steps of the decoders replaced by restarts

    def _new_decoder(self) -> BatchDecoder:
        return BatchDecoder(self.loaded, self.max_sequences, self.plain_rows, isolate=True)

    @property
    def active(self) -> int:
        """Lanes decoding now."""
        return len(self.slots)

    @property
    def queued(self) -> int:
        return self.waiting.qsize()

    @property
    def plain_steps(self) -> int:
        return self.plain_before + self.decoder.plain_steps

    @property
    def steps(self) -> int:
        return self.steps_before + self.decoder.steps

    def start(self) -> None:
        thread = threading.Thread(target=self._main, name="streamfuse-scheduler", daemon=True)
        thread.start()
        self.thread = thread  # /health never sees a worker not yet started

    def close(self) -> None:
        """Stop the worker after its current step; slots left get a Failed event."""
        self.closed = True
        with contextlib.suppress(queue.Full):
            self.waiting.put_nowait(None)
        if self.thread is not None:
            self.thread.join(timeout=30)

    def submit(self, slot: ServerSlot) -> None:
        """Queue a slot; QueueFull at once when the queue holds its maximum or no worker serves."""
        if self.closed:
            raise QueueFull("the server is shutting down")
        if self.down is not None:
            raise QueueFull(f"the server is unhealthy ({self.down})")
        slot.run_id, slot.metrics = str(next(self.counter)), self.metrics
        try:
            self.waiting.put_nowait(slot)
        except queue.Full:
            raise QueueFull(f"the server's queue holds its maximum of {self.waiting.maxsize} requests") from None

    @staticmethod
    def cancel(slot: ServerSlot) -> None:
        """Drop a slot (its client went away): its lane is freed before the next step."""
        slot.cancelled = True

    # --- the worker thread ---

    def _main(self) -> None:
        try:
            self._work()
        except BaseException as error:  # the loop itself died: its requests fail, a fresh worker takes over
            self._died(f"the worker stopped: {type(error).__name__}: {error}")

    def _work(self) -> None:
        faults = 0
        while not self.closed:
            try:
                self._cycle()
                faults = 0
            except Exception as error:  # outside any one request: this cycle's requests fail, the worker goes on
                faults, self.faults = faults + 1, self.faults + 1
                self._fail_all(f"the server failed this request's step ({type(error).__name__}: {error})")
                if faults >= MAX_FAULTS:
                    raise
        self._fail_all("the server is shutting down", 503)
        self._fail_waiting("the server is shutting down")

    def _cycle(self) -> None:
        if not self.slots and not self._admit(block=True):
            return
        self._admit(block=False)
        self._drop_ended()
        if self.slots:
            self._step()

    def _admit(self, block: bool) -> bool:
        """Move queued slots into free lanes (block: wait a while for the first); False when none was admitted."""
        admitted = False
        while len(self.slots) < self.max_sequences:
            try:
                slot = self.waiting.get(block=block and not admitted, timeout=WAKE_SECONDS)
            except queue.Empty:
                break
            if slot is None:  # close()'s wake-up
                break
            admitted |= self._add(slot)
        return admitted

    def _add(self, slot: ServerSlot) -> bool:
        if slot.cancelled:
            slot.state = State.CANCELLED
            return False
        if time.monotonic() > slot.deadline:
            slot.fail(f"the request waited past its deadline of {slot.timeout:g} s (--request-timeout)", 504)
            return False
        if slot.stream:
            slot.detokenizer = Detokenizer.for_tokenizer(self.loaded.tokenizer, slot.stop)
        try:
            slot.lane = self.decoder.add(
                slot.ids, slot.settings, slot.on_step, run_id=slot.run_id, tag=slot.tag, capacity=slot.capacity
            )
        except Exception as error:  # a request the decoder refuses fails alone
            slot.fail(f"the request was refused: {error}", 400, "invalid_request_error")
            return False
        slot.state = State.PREFILLING
        self.slots[slot.lane.id] = slot
        return True

    def _drop_ended(self) -> None:
        """Free the lanes of slots whose client went away or whose deadline passed."""
        now = time.monotonic()
        for lane_id, slot in list(self.slots.items()):
            if slot.cancelled or now > slot.deadline:
                self.decoder.cancel(slot.lane)
                del self.slots[lane_id]
                if slot.cancelled:
                    slot.state = State.CANCELLED
                    self.dropped += 1
                else:
                    slot.fail(f"the request ran past its deadline of {slot.timeout:g} s (--request-timeout)", 504)

    def _step(self) -> None:
        for lane in self.decoder.step():  # isolate: a lane whose own work raised is among these, lane.error set
            slot = self.slots.pop(lane.id, None)
            if slot is None:
                continue
            if lane.error is not None:
                self.faults += 1
                error = lane.error
                slot.fail(f"this request's decode failed ({type(error).__name__}: {error}); other requests go on")
                continue
            slot.finish(self.loaded)

    def _fail_all(self, message: str, status: int = 500) -> None:
        """Fail every admitted slot and free its lane (the decoder may be in any state: nothing here raises)."""
        slots, self.slots = list(self.slots.values()), {}
        self._fail(slots, self.decoder, message, status)

    @staticmethod
    def _fail(slots: list[ServerSlot], decoder: BatchDecoder, message: str, status: int = 500) -> None:
        for slot in slots:
            with contextlib.suppress(Exception):
                decoder.cancel(slot.lane)
            slot.fail(message, status)

    def _fail_waiting(self, message: str) -> None:
        while True:
            try:
                slot = self.waiting.get_nowait()
            except queue.Empty:
                return
            if slot is not None:
                slot.fail(message, 503)

    def _died(self, reason: str) -> None:
        """The worker thread's end by an error: a fresh worker on a fresh decoder (or the scheduler down), then its
        slots fail, so a client that reads its failure finds the server as it will stay (/health)."""
        slots, decoder = list(self.slots.values()), self.decoder
        self.slots = {}
        if not self.closed and self.restarts >= self.max_restarts:
            self.down = f"{reason}; {self.restarts} restarts used: restart the server"
        elif not self.closed:
            self.restarts += 1
            self.plain_before, self.steps_before = self.plain_steps, self.steps
            self.decoder = self._new_decoder()  # the old lanes' caches are in an unknown state
            self.start()
        self._fail(slots, decoder, reason)
        if self.down is not None:
            self._fail_waiting(f"the server is unhealthy ({self.down})")

    def health(self) -> str | None:
        """None while a worker serves, else why not."""
        if self.down is not None:
            return self.down
        if self.thread is not None and not self.thread.is_alive() and not self.closed:
            return "the worker thread is not running"
        return None
