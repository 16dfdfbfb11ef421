"""A request body read and checked within bounds: every way it can be wrong is a RequestError of one line.

    body = await read_body(request, limits.max_body_bytes)        # on the event loop, in chunks: 413 past the limit
    parsed = parse(model, body, chat, name, limits)               # in a worker thread: JSON, fields, tokens

The JSON reader refuses NaN and Infinity (also a float that overflows to it), integers of more than
MAX_INT_DIGITS digits and nesting deeper than MAX_DEPTH; a prompt is capped in characters before it is tokenized;
stop strings in count and length. Fields the server does not use are ignored, as OpenAI's API does, and named in
the answer's X-Streamfuse-Ignored-Fields header.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from streamfuse.runtime.artifact.prompt import check_text
from streamfuse.runtime.request.api import Model, chat_template_ids, checked_messages
from streamfuse.runtime.request.checks import (
    DEFAULT_METHOD,
    DecodeRequest,
    check_fits,
    check_prompt_format,
    decode_settings,
    step_tree,
)
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.settings import DecodeSettings

DEFAULT_MAX_TOKENS = 128  # a request's max_tokens when it names none
MAX_BODY_BYTES = 1 << 20
DRAIN_BYTES = 64 << 20  # a refused body is read on (not kept) up to this, so its client reads the 413
MAX_DEPTH = 32  # JSON nesting
MAX_INT_DIGITS = 24
MAX_FLOAT_CHARS = 40
MAX_STOPS, MAX_STOP_CHARS = 4, 128
MAX_MESSAGES = 256
CHARS_PER_POSITION = 16  # a prompt longer than this x the context cannot fit: refused before tokenizing
FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class RequestError(ValueError):
    """A request the server refuses: its HTTP status and one line saying what to fix."""

    status, kind, code = 400, "invalid_request_error", None

    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(" ".join(str(message).split()))
        self.status = status or self.status
        self.code = code or self.code


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int | None = None  # None: CHARS_PER_POSITION x the model's context
    fault_injection: bool = False  # honour streamfuse_fault_after (the load test's worker fault)


@dataclass(frozen=True)
class Parsed:
    """A checked request: its prompt ids, decode settings and how to answer."""

    chat: bool
    ids: list[int]
    request: DecodeRequest
    settings: DecodeSettings
    capacity: int | None = None  # KV positions check_fits granted it (the decode trusts it); None: unchecked
    stream: bool = False
    steps: bool = False  # streamfuse_steps: each streamed chunk carries its step's tokens
    salt: str | None = None  # cache_salt: a prefix is reused only between requests of the same salt
    fault_after: int | None = None
    ignored: tuple[str, ...] = ()


async def read_body(request, limit: int) -> bytes:
    """The body, read in chunks and refused (413) once past `limit`, before it is all in memory; the rest of a
    refused body is read and dropped (up to DRAIN_BYTES) so that its client gets the answer."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        await _drain(request, int(declared) if declared.isdigit() else DRAIN_BYTES + 1)
        raise RequestError(f"the request body of {declared} bytes exceeds --max-body-bytes {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body exceeds --max-body-bytes {limit}", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request, declared: int) -> None:
    if declared > DRAIN_BYTES:
        return  # the client is left to see the connection close
    async for _ in request.stream():
        pass


def loads(raw: bytes) -> object:
    """JSON within bounds: no NaN or Infinity, integers of at most MAX_INT_DIGITS digits, depth at most MAX_DEPTH."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_refuse_constant, parse_int=_int, parse_float=_float)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as error:
        raise RequestError(f"the request body is not valid JSON ({error.msg} at character {error.pos})") from None
    except UnicodeDecodeError as error:
        raise RequestError(f"the request body is not UTF-8 ({error.reason} at byte {error.start})") from None
    if _depth(body) > MAX_DEPTH:
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels")
    return body


def _refuse_constant(name: str) -> float:
    raise RequestError(f"the request body holds {name}: JSON numbers must be finite")


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError(f"the request body holds an integer of {len(digits)} digits: at most {MAX_INT_DIGITS}")
    return int(digits)


def _float(text: str) -> float:
    value = float(text) if len(text) <= MAX_FLOAT_CHARS else math.inf
    if not math.isfinite(value):
        raise RequestError(f"the number {text[:24]} is too long or too large: JSON numbers must be finite")
    return value


def _depth(value: object) -> int:
    """Nesting depth, without recursion (a body under the reader's own limit may still be deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


# --- fields ----------------------------------------------------------------------------------------

FIELD_TYPES = {  # field -> (accepted types, what the error calls them)
    "model": ((str,), "a string"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "top_k": ((int,), "an integer"),
    "seed": ((int,), "an integer"),
    "stream": ((bool,), "true or false"),
    "method": ((str,), "a string"),
    "n": ((int,), "an integer"),
    "as_task": ((bool,), "true or false"),
    "streamfuse_steps": ((bool,), "true or false"),
    "cache_salt": ((str,), "a string"),
    "streamfuse_fault_after": ((int,), "an integer"),
}
USED = {*FIELD_TYPES, "prompt", "messages", "stop"}


def check_types(body: dict) -> None:
    for name, (types, what) in FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
            raise RequestError(f"'{name}' must be {what}, got {json.dumps(value)[:40]}")
    if body.get("n", 1) not in (1, None):
        raise RequestError("'n' must be 1: this server returns one choice per request")
    for name in ("seed", "top_k"):
        if (body.get(name) or 0) < 0:
            raise RequestError(f"'{name}' must be >= 0, got {body[name]}")
    if len(body.get("cache_salt") or "") > 256:
        raise RequestError("'cache_salt' must be at most 256 characters")


def stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > MAX_STOPS:
        raise RequestError(f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise RequestError(f"'stop': each stop string may have at most {MAX_STOP_CHARS} characters")
    return tuple(value)


def decode_request(body: dict) -> DecodeRequest:
    check_types(body)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    return DecodeRequest(
        method=body.get("method") or DEFAULT_METHOD,
        max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        stop=stop_strings(body.get("stop")),
        temperature=float(body.get("temperature") if body.get("temperature") is not None else 0.0),
        top_k=body.get("top_k") or 0,
        top_p=float(body.get("top_p") if body.get("top_p") is not None else 1.0),
        seed=body.get("seed") or 0,
    )


def bounded_text(value: object, what: str, limit: int) -> str:
    """A non-empty string within `limit` characters (its text is checked where it is tokenized: check_text)."""
    if not isinstance(value, str) or not value:
        raise RequestError(f"{what} must be a non-empty string")
    if len(value) > limit:
        raise RequestError(f"{what} has {len(value)} characters: at most {limit} fit this model's context")
    return value


def completion_ids(model: Model, body: dict, limit: int) -> list[int]:
    """A completion's prompt: its text as it is (as_task: a task source in the task's prompt format)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    prompt = check_text(bounded_text(prompt, "'prompt'", limit), "'prompt'")
    if body.get("as_task"):
        check_prompt_format(model.loaded, "as_task")
        return prompt_ids(model.loaded, prompt, as_task=True, cut_source=False, checked=True)
    return model.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def chat_ids(model: Model, messages: object, limit: int) -> list[int]:
    """A chat's prompt on the chat template; each message a {"role": str, "content": str} object (roles and text:
    runtime/request/api.py's checked_messages, the API's own check)."""
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise RequestError(f'\'messages\' must be a list of 1 to {MAX_MESSAGES} {{"role", "content"}} objects')
    for number, message in enumerate(messages):
        if isinstance(message, dict):
            bounded_text(message.get("content"), f"messages[{number}]'s content", limit)
    checked = checked_messages(messages)
    if sum(len(m["content"]) for m in checked) > limit:
        raise RequestError(f"the messages have more than {limit} characters: more than this model's context")
    return chat_template_ids(model.tokenizer, checked)


def parse(model: Model, body: object, chat: bool, name: str, limits: Limits) -> Parsed:
    """A request body checked and tokenized (slow: run it off the event loop); RequestError of one line."""
    if isinstance(body, bytes):
        body = loads(body)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    request = decode_request(body)  # the types first: a model that is no string is a 400
    if body.get("model") not in (None, name):
        raise RequestError(
            f"the model {body['model'][:80]!r} does not exist: this server serves {name!r} (GET /v1/models)",
            404,
            "model_not_found",
        )
    limit = limits.max_prompt_chars or CHARS_PER_POSITION * model.loaded.backend.max_positions
    ids = chat_ids(model, body.get("messages"), limit) if chat else completion_ids(model, body, limit)
    settings = decode_settings(model.loaded, request)
    capacity = check_fits(model.loaded.backend, ids, settings.rules, step_tree(settings))  # 400 before the queue
    used = USED if limits.fault_injection else USED - {"streamfuse_fault_after"}
    return Parsed(
        chat,
        ids,
        request,
        settings,
        capacity,
        bool(body.get("stream")),
        bool(body.get("streamfuse_steps")),
        body.get("cache_salt"),
        body.get("streamfuse_fault_after") if limits.fault_injection else None,
        tuple(sorted(name if FIELD_NAME.fullmatch(name) else "?" for name in set(body) - used))[:32],
    )
