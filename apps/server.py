"""The HTTP layer of `streamfuse serve --artifact A`: an OpenAI-compatible server on one loaded model.

    GET  /v1/models             the model this server runs
    POST /v1/completions        {"prompt": str, "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"}
    POST /v1/chat/completions   {"messages": [{"role", "content"}, ...], same fields}
    GET  /health                {"status": "ok", lanes decoding, requests waiting}; 503 with the reason when unhealthy
    GET  /metrics               Prometheus text: requests, tokens, latencies, lanes, queue (apps/server_metrics.py)
    GET  /                      a chat page (apps/web_page.py)

Concurrent requests decode together: apps/scheduler.py's scheduler batches them into shared steps (--max-sequences
lanes) behind a bounded queue (--queue: a request beyond it is a 503 at once). `stream: true` answers server-sent
events in OpenAI's chunk format ending with `data: [DONE]`, with a `: keep-alive` comment while no token comes.
Every response carries `usage` and a `streamfuse` object with the speculative stats (the API's Stats); the extra
field `method` picks a decoding method, `as_task: true` reads a completion's prompt as a task source in the task's
prompt format, `cache_salt` keeps a request's cached prefix to requests of the same salt, and
`streamfuse_steps: true` (streamed only) sends a chunk for every decode step with an extra top-level field
`"streamfuse_step": {"step": n, "pieces": [{"text", "draft"}], "rejected": k, "plain": bool}`: the step's tokens
detokenized one at a time (joined, the chunk's text; a piece may be "" while bytes are held back), draft true for
an accepted draft token, the drafted tokens the step threw away, whether it was a plain step; the last chunk (its
finish reason and usage) has none. Fields the server does not use are ignored, as OpenAI's API does, and named in
the X-Streamfuse-Ignored-Fields header; a `model` other than the served one is a 404 `model_not_found`.

Bounded: a body over --max-body-bytes is a 413 (read in chunks, never held whole); JSON with NaN, Infinity, deep
nesting or huge integers, a wrong type, a prompt over the context: a 400 of one line in OpenAI's error shape;
a body that is not `Content-Type: application/json` a 415. Parsing and tokenizing run off the event loop. Every
request has a deadline (--request-timeout: a 504, or an error event in a stream); a failed step fails the request
that caused it (500), the others go on; a dead worker is replaced (or /health says why not and new requests get
503). Access: apps/http_guard.py (Host and Origin checks, --api-key, --cors-origins); --cache-isolation
none|key|request: whose cached prompt prefix a request may reuse (and so see in its `prefill_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from streamfuse.apps.answers import Answer, error_body, error_response, sse
from streamfuse.apps.http_guard import KEY_SCOPE, Access, Guard, is_loopback, read_keys
from streamfuse.apps.request_body import MAX_BODY_BYTES, Limits, Parsed, RequestError, parse, read_body
from streamfuse.apps.scheduler import QueueFull, Scheduler
from streamfuse.apps.server_metrics import Metrics
from streamfuse.apps.slot import Delta, Failed, Finished, ServerSlot
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.commands import errors
from streamfuse.runtime.request.api import Model, load
from streamfuse.runtime.request.batch_policy import POLICIES, POLICY_HELP
from streamfuse.runtime.request.loader import BACKENDS

DISCONNECT_POLL_SECONDS = 0.25  # how often a waiting non-streamed request checks that its client is still there
KEEPALIVE_SECONDS = 5.0  # a stream with no token for this long gets a comment line
SEND_SECONDS = 60.0  # a stream's client that reads nothing for this long is let go
DEADLINE_GRACE = 2.0  # a handler gives up this long after its request's deadline, if the worker did not end it
ISOLATIONS = ("none", "key", "request")


class EventStream:
    """Server-sent events whose every send must complete within SEND_SECONDS; the slot is cancelled however the
    stream ends (done, client gone, client stalled)."""

    def __init__(self, events, slot: ServerSlot, headers: dict):
        from starlette.responses import StreamingResponse

        self.response = StreamingResponse(events, media_type="text/event-stream", headers=headers)
        self.slot = slot

    async def __call__(self, scope, receive, send):
        from starlette.requests import ClientDisconnect

        async def timed(message):
            await asyncio.wait_for(send(message), SEND_SECONDS)

        try:
            await self.response(scope, receive, timed)
        except (TimeoutError, OSError, ClientDisconnect):
            pass  # the client left or stopped reading: the connection closes
        finally:
            Scheduler.cancel(self.slot)


class Server:
    """The handlers over one loaded model and its scheduler."""

    def __init__(self, model: Model, name: str, scheduler: Scheduler, limits: Limits, timeout: float, isolation: str):
        self.model, self.name, self.scheduler = model, name, scheduler
        self.limits, self.timeout, self.isolation = limits, timeout, isolation
        self.keepalive = KEEPALIVE_SECONDS
        self.parser = ThreadPoolExecutor(1, thread_name_prefix="streamfuse-parse")  # one: the tokenizer's caller

    async def models(self, request):
        from starlette.responses import JSONResponse

        model = {"id": self.name, "object": "model", "created": 0, "owned_by": "streamfuse"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        scheduler, reason = self.scheduler, self.scheduler.health()
        body = {"status": "ok" if reason is None else "unavailable", "active": scheduler.active}
        body |= {"queued": scheduler.queued, "restarts": scheduler.restarts, "faults": scheduler.faults}
        if reason is not None:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if reason is None else 503)

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse

        s = self.scheduler
        gauges = {
            "streamfuse_lanes_busy": ("gauge", "lanes decoding a request", s.active),
            "streamfuse_queue_depth": ("gauge", "requests waiting for a lane", s.queued),
            "streamfuse_plain_steps_total": ("counter", "batch steps run as plain rows", s.plain_steps),
            "streamfuse_steps_total": ("counter", "batch steps", s.steps),
            "streamfuse_worker_up": ("gauge", "1 while a worker serves", int(s.health() is None)),
            "streamfuse_worker_restarts_total": ("counter", "workers replaced after dying", s.restarts),
            "streamfuse_worker_faults_total": ("counter", "steps or cycles that raised", s.faults),
        }
        text = s.metrics.render(gauges)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request):
        return await self.answer(request, chat=False)

    async def chat_completions(self, request):
        return await self.answer(request, chat=True)

    async def answer(self, request, chat: bool):
        """Any failure is an answer of one line: 4xx for the request's, 5xx for the server's."""
        try:
            return await self._answer(request, chat)
        except RequestError as error:
            return error_response(error.status, str(error), "invalid_request_error", error.code)
        except (ValueError, TypeError, KeyError, RecursionError) as error:  # the runtime's checks of the request
            return error_response(400, str(error) or type(error).__name__)
        except Exception as error:  # the server's fault: this request's 500, the server keeps serving
            return error_response(500, f"{type(error).__name__}: {error}", "server_error")

    async def _answer(self, request, chat: bool):
        from starlette.responses import JSONResponse

        check_json(request.headers.get("content-type", ""))
        raw = await read_body(request, self.limits.max_body_bytes)
        loop = asyncio.get_running_loop()
        parsed = await loop.run_in_executor(self.parser, parse, self.model, raw, chat, self.name, self.limits)
        if (reason := self.scheduler.health()) is not None:
            return error_response(503, f"the server is unhealthy ({reason})", "server_error")
        slot = ServerSlot(parsed.ids, parsed.settings, loop, parsed.stream, parsed.steps, self.tag(request, parsed))
        slot.timeout, slot.fault_after, slot.capacity = self.timeout, parsed.fault_after, parsed.capacity
        try:
            self.scheduler.submit(slot)
        except QueueFull as error:
            return error_response(503, f"{error}; retry later", "server_busy")
        answer = Answer(parsed, self.name)
        headers = {"X-Streamfuse-Ignored-Fields": ", ".join(parsed.ignored)} if parsed.ignored else {}
        if parsed.stream:
            return EventStream(self.events(slot, answer), slot, headers)
        event = await self.collect(slot, request)
        if event is None:
            return error_response(499, "the client closed the request")
        if isinstance(event, Failed):
            return error_response(event.status, event.message, event.kind)
        return JSONResponse(answer.whole(event.completion), headers=headers)

    def tag(self, request, parsed: Parsed) -> object:
        """Whose cached prefix the request may reuse: anyone's (none), its key's (key), no one's (request); a
        cache_salt narrows it further."""
        if self.isolation == "request":
            return object()  # equal to nothing else
        key = request.scope.get(KEY_SCOPE, "") if self.isolation == "key" else ""
        return (key, parsed.salt) if key or parsed.salt else None

    async def next_event(self, slot: ServerSlot, wait: float):
        """The slot's next event, or None after `wait` seconds without one."""
        try:
            return await asyncio.wait_for(slot.events.get(), max(wait, 0.0))
        except asyncio.TimeoutError:
            return None

    def timed_out(self, slot: ServerSlot) -> Failed | None:
        """A request still waiting past its deadline (the worker did not end it: a step stuck): its failure."""
        if time.monotonic() < slot.deadline + DEADLINE_GRACE:
            return None
        Scheduler.cancel(slot)
        return Failed(f"the request ran past its deadline of {slot.timeout:g} s (--request-timeout)", 504)

    async def collect(self, slot: ServerSlot, request) -> Finished | Failed | None:
        """The slot's end; None when its client went away (the slot is cancelled)."""
        while True:
            event = await self.next_event(slot, DISCONNECT_POLL_SECONDS)
            if isinstance(event, (Finished, Failed)):
                return event
            if event is None and await request.is_disconnected():
                Scheduler.cancel(slot)
                return None
            if (late := self.timed_out(slot)) is not None:
                return late

    async def events(self, slot: ServerSlot, answer: Answer):
        """Server-sent events of a slot, a keep-alive comment while none comes; ends at the slot's end or past its
        deadline (an error event, then [DONE])."""
        if answer.parsed.chat:
            yield sse(answer.chunk("", first=True))
        while True:
            event = await self.next_event(slot, min(self.keepalive, slot.deadline + DEADLINE_GRACE - time.monotonic()))
            if event is None:
                event = self.timed_out(slot)
            if event is None:
                yield ": keep-alive\n\n"
            elif isinstance(event, Delta):
                if event.text or event.step is not None:
                    yield sse(answer.chunk(event.text, step=event.step))
            elif isinstance(event, Finished):
                yield sse(answer.last_chunk(event.rest, event.completion))
                break
            else:
                yield sse(error_body(event.message, event.kind))
                break
        yield sse("[DONE]")


def check_json(content_type: str) -> None:
    """RequestError 415 unless the body is declared JSON (a browser's text/plain form post is not)."""
    media, _, params = content_type.partition(";")
    charset = params.strip().lower().removeprefix("charset=").strip('"') if "charset=" in params.lower() else "utf-8"
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        shown = content_type[:60] or "none"
        raise RequestError(f"the body must be JSON: send 'Content-Type: application/json' (got {shown})", 415)


def create_app(
    model: Model,
    name: str = "streamfuse",
    max_sequences: int = 8,
    queue: int = 64,
    plain_rows: bool = True,
    *,
    limits: Limits | None = None,
    access: Access | None = None,
    request_timeout: float = 600.0,
    cache_isolation: str = "key",
    max_restarts: int = 3,
):
    """The starlette app serving `model` (streamfuse.load's) as `name`; its scheduler runs while the app's lifespan
    does (app.state.scheduler, app.state.server). plain_rows: the batch policy's (runtime/request/batch_policy.py)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    from streamfuse.apps import web_page

    if cache_isolation not in ISOLATIONS:
        raise ValueError(f"cache_isolation must be one of {', '.join(ISOLATIONS)}, got {cache_isolation!r}")
    metrics = Metrics()
    scheduler = Scheduler(model.loaded, max_sequences, queue, plain_rows, metrics, max_restarts)
    server = Server(model, name, scheduler, limits or Limits(), request_timeout, cache_isolation)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.close)
            server.parser.shutdown(wait=False)

    async def http_error(request, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, f"{request.method} {request.url.path}: {error.detail}", kind)

    async def server_error(request, error: Exception):
        return error_response(500, f"{type(error).__name__}: {error}", "server_error")

    routes = [
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        *web_page.routes(),
    ]
    handlers = {HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.scheduler, app.state.server = scheduler, server
    app.add_middleware(Guard, access=access or Access(), metrics=metrics)
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
    parser.add_argument("--model-name", default=None, help="the model's name in the API (default: the folder's)")
    parser.add_argument("--max-sequences", type=int, default=8, help="requests decoded together in one step")
    parser.add_argument("--queue", type=int, default=64, help="requests that may wait; one more is a 503")
    parser.add_argument("--batch-policy", choices=POLICIES, default=POLICIES[0], help=POLICY_HELP)
    parser.add_argument("--api-key", default=None, help="the key clients send as 'Authorization: Bearer <key>'")
    parser.add_argument("--api-key-file", type=Path, default=None, help="keys, one a line (each may be used)")
    parser.add_argument("--allowed-hosts", default="", help="more Host names to answer, comma-separated ('*': any)")
    parser.add_argument("--cors-origins", default="", help="other origins browsers may call from, comma-separated")
    parser.add_argument(
        "--cache-isolation", choices=ISOLATIONS, default="key", help="whose cached prefix a request reuses (key)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="a larger body is a 413")
    parser.add_argument("--max-prompt-chars", type=int, default=None, help="default: 16 x the model's context")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (600)")
    parser.add_argument("--fault-injection", action="store_true", help="honour streamfuse_fault_after (load tests)")
    return parser.parse_args(argv)


def access_of(args: argparse.Namespace) -> Access:
    """The access rules of the command line; UsageError when a server beyond loopback would have no key."""
    try:
        keys = read_keys(args.api_key, args.api_key_file)
    except (OSError, ValueError) as error:
        raise errors.UsageError(f"--api-key-file: {error}") from None
    if not keys and not is_loopback(args.host):
        raise errors.UsageError(
            f"--host {args.host} is reachable beyond this machine: give --api-key or --api-key-file"
        )
    return Access.for_server(args.host, keys, _names(args.allowed_hosts), _names(args.cors_origins))


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.max_sequences < 1 or args.queue < 1:
        raise errors.UsageError(f"--max-sequences and --queue must be >= 1, got {args.max_sequences}, {args.queue}")
    if args.max_body_bytes < 1024 or args.request_timeout <= 0:
        raise errors.UsageError("--max-body-bytes must be >= 1024 and --request-timeout > 0")
    access = access_of(args)
    import uvicorn

    model = load(args.artifact, args.backend, args.task, args.threads)
    limits = Limits(args.max_body_bytes, args.max_prompt_chars, args.fault_injection)
    app = create_app(
        model,
        args.model_name or args.artifact.resolve().name,
        args.max_sequences,
        args.queue,
        args.batch_policy == POLICIES[0],
        limits=limits,
        access=access,
        request_timeout=args.request_timeout,
        cache_isolation=args.cache_isolation,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main))
