"""The server's answers in OpenAI's shapes: a completion, a chat completion, their stream chunks, an error."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict

from streamfuse.apps.request_body import Parsed
from streamfuse.apps.slot import Step
from streamfuse.runtime.request.completion import Completion

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": " ".join(str(message).split()), "type": kind, "param": None, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, kind, code), status_code=status)


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(completion: Completion) -> dict:
    prompt, new = completion.stats.prompt_tokens, len(completion.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}


class Answer:
    """One response's envelope: its id, model and the shape of its choices (completion or chat)."""

    def __init__(self, parsed: Parsed, model: str):
        self.parsed = parsed
        self.model = model
        self.id = f"{'chatcmpl' if parsed.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def envelope(self, kind: str, choice: dict, **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            **extra,
        }

    def extra(self, completion: Completion) -> dict:
        """The usage and speculative stats (the API's Stats, built once by the scheduler) every answer carries."""
        stats = {"method": self.parsed.request.method, **asdict(completion.stats)}
        return {"usage": usage(completion), "streamfuse": stats}

    def whole(self, completion: Completion) -> dict:
        text, finish = completion.text, FINISH_REASONS.get(completion.stop_reason, "stop")
        if self.parsed.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return self.envelope("chat.completion", choice, **self.extra(completion))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self.envelope("text_completion", choice, **self.extra(completion))

    def chunk(self, text: str, finish: str | None = None, first: bool = False, step: Step | None = None, **extra):
        if step is not None:
            extra["streamfuse_step"] = step.json()
        if self.parsed.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self.envelope("chat.completion.chunk", choice, **extra)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self.envelope("text_completion", choice, **extra)

    def last_chunk(self, text: str, completion: Completion) -> dict:
        finish = FINISH_REASONS.get(completion.stop_reason, "stop")
        return self.chunk(text, finish, **self.extra(completion))
