"""streamfuse serve --artifact A: an OpenAI-compatible HTTP server on one loaded model.

    GET  /v1/models             the model this server runs
    POST /v1/completions        {"prompt": str, "max_tokens", "temperature", "top_p", "seed", "stop", "stream"}
    POST /v1/chat/completions   {"messages": [{"role", "content"}, ...], same fields}
    GET  /health                lanes decoding and requests waiting

Concurrent requests decode together: apps/serving.py's scheduler batches them into shared steps (--max-sequences
lanes) behind a bounded queue (--queue: a request beyond it is a 503 at once). `stream: true` answers server-sent
events in OpenAI's chunk format ending with `data: [DONE]`. Every response carries `usage` and a `streamfuse`
object with the speculative stats (the API's Stats); the extra field `method` picks a decoding method, and
`as_task: true` reads a completion's prompt as a task source in the task's prompt format. A malformed request or
one over the context is a 400 with a one-line message; a client that goes away frees its lane; the server keeps
serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from streamfuse.apps.serving import Finished, Job, QueueFull, Scheduler, Tokens, check_fits
from streamfuse.runtime import errors
from streamfuse.runtime.api import Model, load
from streamfuse.runtime.batch_policy import POLICIES, POLICY_HELP
from streamfuse.runtime.options import BACKENDS
from streamfuse.runtime.prompt import check_text
from streamfuse.runtime.session import DEFAULT_METHOD, DecodeRequest, decode_settings
from streamfuse.runtime.text_stream import Detokenizer
from streamfuse.runtime.threads import threads_type

DEFAULT_MAX_TOKENS = 128  # a request's max_tokens when it names none
DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streamed request checks that its client is still there
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


class BadRequest(ValueError):
    """A request the server refuses with a 400: its one line says what to fix."""


# --- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parsed:
    """A checked request: its prompt ids, decode settings and how to answer."""

    chat: bool
    ids: list[int]
    request: DecodeRequest
    stream: bool


FIELD_TYPES = {  # field -> (accepted types, what the error calls them)
    "model": ((str,), "a string"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "seed": ((int,), "an integer"),
    "stream": ((bool,), "true or false"),
    "method": ((str,), "a string"),
    "n": ((int,), "an integer"),
}


def check_types(body: dict) -> None:
    for name, (types, what) in FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
            raise BadRequest(f"'{name}' must be {what}, got {json.dumps(value)[:40]}")
    if body.get("n", 1) != 1:
        raise BadRequest("'n' must be 1: this server returns one choice per request")
    if (body.get("seed") or 0) < 0:
        raise BadRequest(f"'seed' must be >= 0, got {body['seed']}")


def stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > 4:
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them")
    return tuple(value)


def decode_request(body: dict) -> DecodeRequest:
    check_types(body)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    fields = {
        "method": body.get("method") or DEFAULT_METHOD,
        "max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "stop": stop_strings(body.get("stop")),
        "temperature": float(body.get("temperature", 0.0) if body.get("temperature") is not None else 0.0),
        "top_p": float(body.get("top_p") if body.get("top_p") is not None else 1.0),
        "seed": body.get("seed") or 0,
    }
    return DecodeRequest(**fields)


def completion_ids(model: Model, prompt: object, as_task: object) -> list[int]:
    """A completion's prompt: its text as it is (as_task: a task source in the task's prompt format)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(as_task, bool):
        raise BadRequest(f"'as_task' must be true or false, got {json.dumps(as_task)[:40]}")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string")
    check_text(prompt, "the prompt")
    if as_task:
        return model.prompt_ids(prompt, as_task=True)
    return model.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def parse(model: Model, body: object, chat: bool) -> tuple[Parsed, object]:
    """The request checked (BadRequest / ValueError of one line) and its decode settings."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    request = decode_request(body)
    if chat:
        ids = model.chat_ids(body.get("messages"))  # the task's chat template, each message checked
    else:
        ids = completion_ids(model, body.get("prompt"), body.get("as_task", False))
    settings = decode_settings(model.loaded, request)
    check_fits(model.loaded, ids, settings)
    return Parsed(chat, ids, request, bool(body.get("stream", False))), settings


# --- responses -----------------------------------------------------------------------------------


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": " ".join(str(message).split()), "type": kind, "param": None, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error"):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, kind), status_code=status)


def stats(done: Finished, method: str, first: float) -> dict:
    """The API's Stats of a finished job and its method; first: seconds from the request's arrival to its first
    token (its wait in the queue included)."""
    return {"method": method, **asdict(replace(done.completion.stats, time_to_first_token=first))}


def usage(done: Finished) -> dict:
    prompt, new = done.completion.stats.prompt_tokens, len(done.completion.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


class Answer:
    """One response's envelope: its id, model and the shape of its choices (completion or chat)."""

    def __init__(self, parsed: Parsed, model: str):
        self.parsed = parsed
        self.model = model
        self.id = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.arrived = time.perf_counter()
        self.first: float | None = None  # when the first token came

    def tokens(self, event: Tokens) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def envelope(self, kind: str, choice: dict, **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            **extra,
        }

    def extra(self, done: Finished) -> dict:
        """The usage and speculative stats every finished answer carries."""
        first = (self.first or time.perf_counter()) - self.arrived
        return {"usage": usage(done), "streamfuse": stats(done, self.parsed.request.method, first)}

    def whole(self, done: Finished) -> dict:
        text = done.completion.text
        finish = FINISH_REASONS.get(done.completion.stop_reason, "stop")
        extra = self.extra(done)
        if self.parsed.chat:
            message = {"role": "assistant", "content": text}
            return self.envelope("chat.completion", {"index": 0, "message": message, "finish_reason": finish}, **extra)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self.envelope("text_completion", choice, **extra)

    def chunk(self, text: str, finish: str | None = None, first: bool = False, **extra) -> dict:
        if self.parsed.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self.envelope("chat.completion.chunk", choice, **extra)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self.envelope("text_completion", choice, **extra)

    def last_chunk(self, text: str, done: Finished) -> dict:
        return self.chunk(text, FINISH_REASONS.get(done.completion.stop_reason, "stop"), **self.extra(done))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# --- the app -------------------------------------------------------------------------------------


class Server:
    """The handlers over one loaded model and its scheduler."""

    def __init__(self, model: Model, name: str, scheduler: Scheduler):
        self.model = model
        self.name = name
        self.scheduler = scheduler

    async def models(self, request):
        from starlette.responses import JSONResponse

        model = {"id": self.name, "object": "model", "created": 0, "owned_by": "streamfuse"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"active": self.scheduler.active, "queued": self.scheduler.queued})

    async def completions(self, request):
        return await self.answer(request, chat=False)

    async def chat_completions(self, request):
        return await self.answer(request, chat=True)

    async def answer(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return error_response(400, f"the request body is not valid JSON ({getattr(error, 'msg', error)})")
        try:
            parsed, settings = parse(self.model, body, chat)
        except ValueError as error:
            return error_response(400, str(error))
        answer = Answer(parsed, self.name)
        job = Job(parsed.ids, settings, asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except QueueFull as error:
            return error_response(503, f"{error}; retry later", "server_busy")
        if parsed.stream:
            return StreamingResponse(self.events(job, answer), media_type="text/event-stream")
        try:
            done = await self.collect(job, answer, request)
        except ValueError as error:
            return error_response(400, str(error))
        except Exception as error:  # an engine failure: this request's 500, the server keeps serving
            return error_response(500, f"{type(error).__name__}: {error}", "server_error")
        if done is None:
            return error_response(499, "the client closed the request")
        return JSONResponse(answer.whole(done))

    def detokenizer(self, job: Job) -> Detokenizer:
        return Detokenizer.for_tokenizer(self.model.tokenizer, job.settings.rules.stop_strings)

    async def collect(self, job: Job, answer: Answer, request) -> Finished | None:
        """The job's end; None when its client went away (the job is cancelled)."""
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.scheduler.cancel(job)
                    return None
                continue
            if isinstance(event, Tokens):
                answer.tokens(event)
            elif isinstance(event, Finished):
                return event
            else:
                raise event.error

    async def events(self, job: Job, answer: Answer) -> AsyncIterator[str]:
        """Server-sent events of a job; the job is cancelled if the client goes away (the task is cancelled)."""
        deltas = self.detokenizer(job)
        try:
            if answer.parsed.chat:
                yield sse(answer.chunk("", first=True))
            while True:
                event = await job.events.get()
                if isinstance(event, Tokens):
                    answer.tokens(event)
                    text = deltas.push(event.ids)
                    if text:
                        yield sse(answer.chunk(text))
                elif isinstance(event, Finished):
                    yield sse(answer.last_chunk(deltas.finish(), event))
                    break
                else:
                    yield sse(error_body(str(event.error), "server_error"))
                    break
            yield sse("[DONE]")
        finally:
            self.scheduler.cancel(job)  # a no-op once the job finished; frees the lane of a client gone mid-stream


def create_app(model: Model, name: str = "streamfuse", max_sequences: int = 8, queue: int = 64, hold: bool = True):
    """The starlette app serving `model` (streamfuse.load's); its scheduler runs while the app's lifespan does
    (app.state.scheduler). hold: the batch policy's (runtime/batch_policy.py)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    scheduler = Scheduler(model.loaded, max_sequences, queue, hold)
    server = Server(model, name, scheduler)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.close)

    async def http_error(request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind)

    routes = [
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.scheduler = scheduler
    return app


# --- the command ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="an exported artifact or a checkpoint folder")
    parser.add_argument(
        "--backend", choices=("auto", *BACKENDS), default="auto", help="the engine (auto: the fastest it has here)"
    )
    parser.add_argument("--threads", type=threads_type, default=None, help="CPU threads of the engine")
    parser.add_argument("--task", default=None, help="on an artifact of several tasks, the one to serve")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default: 8000)")
    parser.add_argument("--max-sequences", type=int, default=8, help="requests decoded together in one step")
    parser.add_argument("--queue", type=int, default=64, help="requests that may wait; one more is a 503")
    parser.add_argument("--batch-policy", choices=POLICIES, default=POLICIES[0], help=POLICY_HELP)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_sequences < 1 or args.queue < 1:
        raise errors.UsageError(f"--max-sequences and --queue must be >= 1, got {args.max_sequences}, {args.queue}")
    import uvicorn

    model = load(args.artifact, args.backend, args.task, args.threads)
    hold = args.batch_policy == POLICIES[0]
    app = create_app(model, args.artifact.resolve().name, args.max_sequences, args.queue, hold)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
