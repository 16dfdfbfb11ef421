"""streamfuse as a library: load a model, generate text (whole or streamed), chat, keep a chat's cache.

    import streamfuse
    model = streamfuse.load("artifacts/dialogsum")            # the fastest engine the artifact has here
    done = model.generate("Hi!", max_new_tokens=32)            # Completion: text, token_ids, stop_reason, stats
    for delta in model.generate("Hi!", stream=True): print(delta, end="")
    chat = model.conversation(); chat.send("Hi!"); chat.send("And then?")  # the second turn prefills only its tokens

Everything runs in the caller's thread: a stream is a generator that makes one decode step per delta it needs,
so a caller that stops iterating stops the decode. A Model decodes one generation at a time on its cache
(starting another ends an unfinished stream); each Conversation has a cache of its own (Loaded.with_own_cache),
kept between its turns. Bad values are ValueErrors of one line, raised when the call is made, before any decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from streamfuse.runtime.artifact.prompt import check_text
from streamfuse.runtime.backends.threads import check_threads, use_threads
from streamfuse.runtime.request.batch import BatchDecoder
from streamfuse.runtime.request.checks import DEFAULT_METHOD, DecodeRequest, check_prompt_format, decode_settings
from streamfuse.runtime.request.completion import Completion
from streamfuse.runtime.request.decode import StepEvent
from streamfuse.runtime.request.frontend import load_model
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.lifecycle import State
from streamfuse.runtime.request.loader import BACKENDS, Loaded
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.request.slot import Slot
from streamfuse.runtime.request.text_stream import Detokenizer
from streamfuse.runtime.request.trace import Trace

ROLES = ("system", "user", "assistant")  # the roles a chat template renders


class TextStream:
    """A generation streamed as text deltas: whole characters only, never a stop string's text; the deltas joined
    equal the Completion's text, which `completion` holds once the stream is exhausted."""

    def __init__(self, deltas: Iterator[str], on_done: Callable[[Completion], None] | None = None):
        self._deltas = deltas
        self._on_done = on_done
        self.completion: Completion | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        """Stop the generation where it is (no completion)."""
        self._deltas.close()

    def _finish(self, completion: Completion) -> None:
        self.completion = completion
        if self._on_done is not None:
            self._on_done(completion)


def _one_lane(loaded: Loaded) -> BatchDecoder:
    """A batch of one sequence on `loaded`'s own cache: how the API drives a generation, as the server drives
    many (greedy speculative steps stay speculative: no plain-rows policy at one sequence)."""
    return BatchDecoder(loaded, max_sequences=1, plain_rows=False, own_cache=True)


class Model:
    """A loaded artifact or checkpoint: generate, chat, or open conversations that keep their cache."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self._decoder = _one_lane(loaded)

    @property
    def backend(self) -> str:
        """The engine this model runs on (executorch, onnxruntime, torch, ...)."""
        return self.loaded.engine

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def methods(self) -> tuple[str, ...]:
        """The decoding methods this model carries drafters for."""
        return self.loaded.methods

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        method: str = DEFAULT_METHOD,
        temperature: float = 0.0,
        stream: bool = False,
        stop: Sequence[str] = (),
        *,
        as_task: bool = False,
        **options,
    ) -> Completion | TextStream:
        """Answer a user message (rendered in the chat template), a task's source (`as_task`: in the task's prompt
        format, as the model was fine-tuned) or token ids as they are. `options`: DecodeRequest's other fields
        (top_k, top_p, seed, tree, fallback, ...). stream: a TextStream of text deltas instead of a Completion."""
        request = make_request(max_new_tokens, method, temperature, stop, options)
        return self.run(self.prompt_ids(prompt, as_task), request, stream)

    def chat(
        self,
        messages: Sequence[dict],
        max_new_tokens: int = 128,
        method: str = DEFAULT_METHOD,
        temperature: float = 0.0,
        stream: bool = False,
        stop: Sequence[str] = (),
        **options,
    ) -> Completion | TextStream:
        """The assistant's next message after `messages` ({"role": "system" | "user" | "assistant", "content":
        text}), on the task's chat template. Stateless: every call prefills the whole conversation (a
        Conversation keeps its cache instead)."""
        request = make_request(max_new_tokens, method, temperature, stop, options)
        return self.run(self.chat_ids(messages), request, stream)

    def conversation(self, system: str | None = None) -> Conversation:
        """A chat with a cache of its own, kept between turns (`system`: a first system message)."""
        return Conversation(self, system)

    def batch(self, max_sequences: int = 8, plain_rows: bool = True):
        """Several requests decoded together, one shared step per round (runtime/request/batch.py's BatchDecoder;
        plain_rows: its batch policy, plain rows for greedy speculative sequences where they make more tokens/s)."""
        return BatchDecoder(self.loaded, max_sequences, plain_rows)

    def prompt_ids(self, prompt: str | Sequence[int], as_task: bool = False) -> list[int]:
        """Token ids of a prompt: a user message in the chat template, a task source in the task's prompt format
        (as_task), or ids given as they are (checked when they run: runtime/request/checks.py's check_fits)."""
        if isinstance(prompt, str):
            if as_task:
                check_prompt_format(self.loaded, "as_task")
            return prompt_ids(self.loaded, prompt, as_task, cut_source=False)
        if as_task:
            raise ValueError("as_task formats a source text: pass the source as a str, or drop as_task")
        return list(prompt)

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a conversation on the chat template, ending where the assistant's answer starts."""
        return chat_template_ids(self.tokenizer, checked_messages(messages))

    def run(
        self,
        ids: Sequence[int],
        request: DecodeRequest | None = None,
        stream: bool = False,
        trace: Trace | None = None,
        run_id: str = "0",
        on_step: Callable[[StepEvent], None] | None = None,
        settings: DecodeSettings | None = None,
    ) -> Completion | TextStream:
        """Decode prompt token ids as a front end states its request (runtime/request/checks.py's DecodeRequest: the CLI
        from its flags, a server from its JSON); `trace` records the run under `run_id` (tools/profiler.py);
        `on_step` sees each step's StepEvent (the tokens, how many were accepted drafts, the draft verified), an
        exception it raises ending the generation there. settings: the request's decode_settings where the caller
        made them already (the CLI, for its trace's header; the tools, which give no request: no stop strings); the
        prompt ids are checked as the generation begins. Every front end and tool drives a generation here."""
        if request is None and settings is None:
            raise ValueError("Model.run needs a DecodeRequest or the DecodeSettings made of one")
        settings = decode_settings(self.loaded, request) if settings is None else settings
        slot = Slot(list(ids), settings, trace=trace, run_id=run_id, observer=on_step)
        return _start(self._decoder, slot, stream)


def _start(decoder: BatchDecoder, slot: Slot, stream: bool, on_done=None) -> Completion | TextStream:
    """Ready the cache at the call (its errors come there, not at the first delta), then decode: to the end, or
    as a stream. on_done: called with the Completion once the generation ends."""
    holder = TextStream(iter(()), on_done)
    deltas = _decode(decoder, slot, holder, incremental=stream)
    next(deltas)  # Generation.begin: the prompt's checks (request.check_fits), then the cache reset (or kept rows)
    holder._deltas = deltas
    if stream:
        return holder
    for _ in deltas:
        pass
    return holder.completion


def _decode(decoder: BatchDecoder, slot: Slot, holder: TextStream, incremental: bool) -> Iterator[str]:
    """Generator: yields once, empty, once the slot has its lane; then each step's delta (incremental), and sets
    holder.completion at the end. A later generation on the decoder cancels this one: its next delta raises."""
    for unfinished in list(decoder.active):  # a stream nobody finished: superseded
        decoder.cancel(unfinished)
    if incremental:
        slot.detokenizer = Detokenizer.for_tokenizer(decoder.loaded.tokenizer, slot.stop)
    fresh: list[int] = []

    def on_step(event: StepEvent) -> None:
        fresh.extend(event.tokens)
        slot.on_step(event)

    def delta() -> str:
        tokens = list(fresh)
        fresh.clear()
        return slot.detokenizer.push(tokens) if incremental else ""

    slot.lane = decoder.add(slot.ids, slot.settings, on_step, run_id=slot.run_id, keep=slot.keep, trace=slot.trace)
    slot.state = State.PREFILLING
    try:
        yield ""
        _check_active(slot)
        decoder.prefill()
        while True:
            piece = delta()
            if piece:
                yield piece
            if slot.lane.done:
                break
            _check_active(slot)
            decoder.step()
    finally:
        decoder.cancel(slot.lane)  # a closed or failed stream frees its cache; a finished lane has left already
        if slot.lane.state is not State.DONE:
            slot.state = slot.lane.state
    rest = slot.detokenizer.finish() if incremental else ""
    holder._finish(slot.finish(decoder.loaded))
    if rest:
        yield rest


def _check_active(slot: Slot) -> None:
    if slot.lane.state is State.CANCELLED:
        raise RuntimeError(
            "a later generation on the same model ended this stream's: finish a stream before starting the "
            "next, or give each conversation its own model.conversation()"
        )


class Conversation:
    """A conversation on a cache of its own: each turn renders the whole conversation, keeps the cache rows its
    last turn left where they match, and prefills only the rest; the answer equals a fresh generation of the
    whole conversation, token for token."""

    def __init__(self, model: Model, system: str | None = None):
        self.model = model
        self.messages: list[dict] = [] if system is None else checked_messages([{"role": "system", "content": system}])
        self._decoder = _one_lane(model.loaded.with_own_cache())

    def send(
        self,
        text: str,
        max_new_tokens: int = 128,
        method: str = DEFAULT_METHOD,
        temperature: float = 0.0,
        stream: bool = False,
        stop: Sequence[str] = (),
        **options,
    ) -> Completion | TextStream:
        """The assistant's answer to the user's `text`; the turn joins the conversation once its answer is complete
        (a stream: once exhausted). stats.prefill_tokens counts only the tokens the cache did not hold."""
        request = make_request(max_new_tokens, method, temperature, stop, options)
        messages = [*self.messages, *checked_messages([{"role": "user", "content": text}])]
        loaded = self._decoder.loaded
        ids = chat_template_ids(loaded.tokenizer, messages)  # each message checked as it joined
        slot = Slot(ids, decode_settings(loaded, request), keep=True)
        return _start(self._decoder, slot, stream, lambda done: self._record(messages, done))

    def _record(self, messages: list[dict], completion: Completion) -> None:
        self.messages = [*messages, {"role": "assistant", "content": completion.text}]

    @property
    def cached_ids(self) -> list[int]:
        """The token ids this conversation's cache holds (its last turn's prompt and answer), which the next turn keeps
        where its prompt starts with them."""
        return list(self._decoder.held_ids() or ())

    @property
    def cached_tokens(self) -> int:
        """Rows of this conversation's cache in use."""
        return int(getattr(self._decoder.loaded.backend, "length", 0))

    @property
    def memory_bytes(self) -> int:
        """What this conversation holds: its cache rows in use x each row's keys and values (all layers), plus its
        conversation's text and the ids its cache holds."""
        rows = self.cached_tokens * row_bytes(self._decoder.loaded.backend)
        text = sum(len(m["content"].encode("utf-8")) for m in self.messages)
        return rows + text + 8 * len(self.cached_ids)

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and the cache."""
        self.messages = [m for m in self.messages if m["role"] == "system"][:1]
        self._decoder.forget()


def row_bytes(backend) -> int:
    """Bytes of one cache position (keys and values of every layer), where the backend exposes its buffers."""
    keys, values = getattr(backend, "keys", None), getattr(backend, "values", None)
    if keys is None or values is None or not getattr(keys, "shape", None):
        return 0
    return int((keys.nbytes + values.nbytes) // max(1, keys.shape[2]))


def make_request(max_new_tokens, method, temperature, stop, options: dict) -> DecodeRequest:
    """A DecodeRequest from the API's arguments (unknown options refused; its fields are checked once, by
    decode_settings, when the call runs it)."""
    unknown = sorted(set(options) - set(DecodeRequest.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}: use one of {', '.join(DecodeRequest.__dataclass_fields__)}")
    if isinstance(stop, str):
        stop = (stop,)
    request = replace(
        DecodeRequest(),
        max_new_tokens=max_new_tokens,
        method=method,
        temperature=temperature,
        stop=tuple(stop),
        **options,
    )
    return request


def chat_template_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Checked messages on the chat template, ending where the assistant's answer starts."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def checked_messages(messages: Sequence[dict]) -> list[dict]:
    """A conversation as the chat template takes it: role and text content per message."""
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError('messages: give a non-empty list of {"role": ..., "content": ...} dicts')
    checked = []
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f'messages[{number}] must be an object {{"role": ..., "content": ...}}')
        if message.get("role") not in ROLES:
            raise ValueError(f"messages[{number}]: needs a role among {', '.join(ROLES)}")
        check_text(message.get("content"), f"messages[{number}]'s content")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def load(artifact: str | Path, backend: str = "auto", task: str | None = None, threads: int | None = None) -> Model:
    """Open an artifact (or a fine-tuned checkpoint) for generation. backend: "auto" (the fastest the artifact
    has here, by its calibrations) or one of runtime/request/loader.py's BACKENDS; task: on an artifact serving several
    tasks, the task to run; threads: the engines' CPU threads (None: each engine's own)."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not available: use auto or one of {', '.join(BACKENDS)}")
    check_threads(threads, "threads")
    loaded = load_model(Path(artifact), None if backend == "auto" else backend, threads=threads, task=task)
    use_threads(threads)
    return Model(loaded)
