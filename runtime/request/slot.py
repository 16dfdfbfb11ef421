"""A request's life in one object, a Slot: its prompt and settings, where it stands (runtime/request/lifecycle.py's
states), its lane of a BatchDecoder while it decodes, its detokenizer, its time to first token and its Completion.

    slot = Slot(ids, settings)
    slot.lane = decoder.add(slot.ids, slot.settings, slot.on_step, ...)   # the front end moves it to prefilling
    ... decoder.prefill() / step(): slot.on_step times the first token (decoding) and tells its observer ...
    completion = slot.finish(loaded)                                         # done: the Completion, built here once

Model.run drives one through a BatchDecoder of one lane (runtime/request/api.py); the server's worker drives many
(apps/scheduler.py), its slots adding what HTTP needs (apps/slot.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from streamfuse.runtime.request.batch import Lane
from streamfuse.runtime.request.completion import Completion, Stats
from streamfuse.runtime.request.decode import StepEvent
from streamfuse.runtime.request.lifecycle import ENDED, State
from streamfuse.runtime.request.loader import Loaded
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.text_stream import Detokenizer, final_text
from streamfuse.runtime.request.trace import Trace


@dataclass(eq=False)
class Slot:
    """One request, from queued to done, failed or cancelled."""

    ids: list[int]
    settings: DecodeSettings
    _: KW_ONLY
    keep: bool = False  # start from the rows its cache's last sequence left (a conversation's next turn)
    trace: Trace | None = None
    run_id: str = "0"
    observer: Callable[[StepEvent], None] | None = None  # sees each step's StepEvent (a demo marks the drafts)
    state: State = State.QUEUED
    arrived: float = field(default_factory=time.monotonic)
    first_token: float | None = None  # seconds from arrival to the first token
    detokenizer: Detokenizer | None = None  # a streamed request's: its text as it comes
    lane: Lane | None = None  # its lane of a BatchDecoder, once admitted
    completion: Completion | None = None

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.settings.rules.stop_strings)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def on_step(self, event: StepEvent) -> None:
        """The decoder's callback: the first token moves it to decoding and sets its time; the observer sees it."""
        if self.first_token is None:
            self.first_token = time.monotonic() - self.arrived
            self.state = State.DECODING
        if self.observer is not None:
            self.observer(event)

    def finish(self, loaded: Loaded) -> Completion:
        """Its lane's result as the API and the server report it (built here only), the slot done."""
        generation = self.lane.generation
        result = self.lane.result
        record = result.run
        steps = record.steps
        stats = Stats(
            new_tokens=record.new_tokens,
            steps=record.model_calls - 1,
            accepted_per_step=sum(s.accepted_depth for s in steps) / len(steps) if steps else 0.0,
            model_calls=record.model_calls,
            seconds=record.seconds,
            prefill_tokens=generation.prefilled,
            time_to_first_token=self.first_token or 0.0,
            prompt_tokens=record.prompt_tokens,
        )
        raw = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        text = final_text(raw, self.stop)
        self.completion = Completion(text, list(result.token_ids), result.stop_reason, stats, record)
        self.state = State.DONE
        return self.completion
