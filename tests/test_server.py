"""`streamfuse serve` (apps/server.py, apps/scheduler.py): the official openai client against a server on loopback.

Each response equals the single-request decode of its prompt, streamed or not; a malformed or over-context request
is a 400 of one line; a full queue a 503; a client gone mid-stream frees its lane; the server keeps answering."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

pytest.importorskip("starlette", reason="the server extra (pip install 'streamfuse[server]')")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra (pip install 'streamfuse[server]')")
openai = pytest.importorskip("openai", reason="the dev extra's official client")

from streamfuse.apps.scheduler import Scheduler  # noqa: E402
from streamfuse.apps.server import create_app  # noqa: E402
from streamfuse.apps.slot import Delta, Finished, ServerSlot  # noqa: E402
from streamfuse.runtime.request import api, frontend  # noqa: E402

from tiny_export import EXPORTED  # noqa: E402

PROMPT = "the people said what time it is"
MESSAGES = [{"role": "user", "content": "how are you"}]


@dataclass
class Served:
    url: str
    app: object
    server: object
    thread: threading.Thread

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, **options)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(loaded, lifespan: str = "on", name: str = "tiny", **options) -> Served:
    """The app on a free loopback port, uvicorn in a thread (lifespan "off": the scheduler never starts)."""
    app = create_app(loaded, name, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """The API's reference answers: a model of its own, apart from the one the server decodes on."""
    return api.load(checkpoint / "ckpt")


@pytest.fixture(scope="module")
def served(checkpoint):
    running = serve(api.load(checkpoint / "ckpt"), max_sequences=4, queue=8)
    yield running
    running.stop()


def reference(model, text: str, max_tokens: int, chat: bool = False, stop: tuple[str, ...] = ()):
    """The API's answer to the same request, on a model of its own: a completion's prompt as raw text (its token
    ids), a chat's messages on the chat template."""
    if chat:
        return model.chat(MESSAGES, max_new_tokens=max_tokens, stop=stop)
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    return model.generate(ids, max_new_tokens=max_tokens, stop=stop)


def post(url: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_idle(served: Served, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while served.scheduler.active or served.scheduler.queued:
        assert time.monotonic() < deadline, f"lanes still active: {served.scheduler.active}"
        time.sleep(0.05)


def test_models_lists_the_served_model(served):
    models = served.client().models.list()
    assert [model.id for model in models.data] == ["tiny"]


def test_a_completion_equals_the_single_request_decode_with_usage_and_stats(served, loaded):
    answer = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12)
    expected = reference(loaded, PROMPT, 12)
    assert answer.choices[0].text == expected.text and expected.text
    assert answer.choices[0].finish_reason == "length"
    prompt_tokens = expected.stats.prompt_tokens
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 12)
    assert answer.usage.total_tokens == prompt_tokens + 12
    stats = answer.model_extra["streamfuse"]
    assert stats["method"] == frontend.DEFAULT_METHOD and stats["model_calls"] == stats["steps"] + 1
    assert (stats["steps"], stats["model_calls"]) == (expected.stats.steps, expected.stats.model_calls)
    assert stats["accepted_per_step"] == expected.stats.accepted_per_step and stats["new_tokens"] == 12
    assert stats["prefill_tokens"] == prompt_tokens and 0 < stats["time_to_first_token"]


def test_a_chat_completion_uses_the_chat_template(served, loaded):
    answer = served.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10)
    expected = reference(loaded, "", 10, chat=True)
    assert answer.choices[0].message.content == expected.text and answer.choices[0].message.role == "assistant"
    usage = (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert usage == (expected.stats.prompt_tokens, len(expected.token_ids))
    assert answer.choices[0].finish_reason == ("length" if len(expected.token_ids) == 10 else "stop")


def test_the_method_field_picks_the_method_and_every_method_answers_the_same(served, loaded):
    client = served.client()
    plain = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, extra_body={"method": frontend.BASELINE_METHOD}
    )
    assert plain.choices[0].text == reference(loaded, PROMPT, 12).text
    stats = plain.model_extra["streamfuse"]
    assert stats["method"] == frontend.BASELINE_METHOD and stats["accepted_per_step"] == 0
    assert stats["model_calls"] == 12  # plain decoding: the prefill, then one call per further token


def test_as_task_reads_the_prompt_as_a_task_source(served, loaded):
    dialogue = "#Person1#: what time is it #Person2#: it is time"
    answer = served.client().completions.create(
        model="tiny", prompt=dialogue, max_tokens=8, extra_body={"as_task": True}
    )
    expected = loaded.generate(dialogue, 8, as_task=True)
    assert answer.choices[0].text == expected.text and answer.usage.prompt_tokens == expected.stats.prompt_tokens


def test_streamed_deltas_join_to_the_non_streamed_text(served, loaded):
    client = served.client()
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole == reference(loaded, PROMPT, 16).text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 16
    chat = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chat) == reference(loaded, "", 10, chat=True).text


def test_a_stop_string_is_never_sent(served, loaded):
    text = reference(loaded, PROMPT, 16).text
    stop = text.split()[3]
    client = served.client()
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stop=[stop]).choices[0].text
    streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stop=stop, stream=True)
    assert whole == "".join(c.choices[0].text for c in streamed) == reference(loaded, PROMPT, 16, stop=(stop,)).text
    assert stop not in whole and text.startswith(whole)


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"prompt": 3}, "'prompt' must be a non-empty string"),
    ({"prompt": "hi", "max_tokens": "9"}, "'max_tokens' must be an integer"),
    ({"prompt": "hi", "max_tokens": 0}, "max_new_tokens must be > 0"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "'stream' must be true or false"),
    ({"prompt": "hi", "method": "nope"}, "method must be one of"),
    ({"prompt": "hi", "seed": -1}, "'seed' must be >= 0"),
    ({"prompt": "hi", "stop": [""]}, "'stop' must be"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "'prompt' must be a non-empty string"),
    ({"prompt": "hi", "max_tokens": 100000}, "exceeds the model's context"),
]


@pytest.mark.parametrize(
    "body, message", BAD_BODIES, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD_BODIES)]
)
def test_a_bad_request_is_a_400_of_one_line(served, body, message):
    status, answer = post(f"{served.url}/v1/completions", body)
    assert status == 400, answer
    assert message in answer["error"]["message"] and "\n" not in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_the_client_sees_400s_and_404s_and_the_server_keeps_answering(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    status, answer = post(f"{served.url}/v1/nowhere", {})
    assert status == 404 and "/v1/nowhere" in answer["error"]["message"]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_a_client_gone_mid_stream_frees_its_lane(served, loaded, monkeypatch):
    decoder, dropped = served.scheduler.decoder, served.scheduler.dropped
    step = decoder.step

    def slow_step():  # 200 tokens take seconds: the lane is still decoding when its client leaves
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(decoder, "step", slow_step)
    client = served.client()
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200, stream=True)
    next(iter(stream))
    assert served.scheduler.active == 1
    stream.close()
    wait_idle(served)
    assert served.scheduler.dropped == dropped + 1 and not decoder.active
    monkeypatch.undo()
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
    assert answer.choices[0].text == reference(loaded, PROMPT, 8).text
    wait_idle(served)


def test_concurrent_requests_each_equal_their_single_request_decode(served, loaded):
    prompts = [PROMPT, "what time is it", "they said you are not there", "how many people"]
    answers: dict[str, str] = {}

    def ask(prompt: str) -> None:
        answers[prompt] = served.client().completions.create(model="tiny", prompt=prompt, max_tokens=10).choices[0].text

    threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert answers == {prompt: reference(loaded, prompt, 10).text for prompt in prompts}


@pytest.mark.parametrize("backend", EXPORTED)
def test_concurrent_requests_on_an_exported_engine_equal_their_single_request_output(artifact, backend):
    """Batched steps on the graphs' batched step method: each answer still equals its single-request one."""
    running = serve(api.load(artifact, backend), max_sequences=4, queue=8)
    prompts = [PROMPT, "what time is it", "they said you are not there", "how many people"]
    answers: dict[str, str] = {}

    def ask(prompt: str) -> None:
        stream = running.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True)
        answers[prompt] = "".join(chunk.choices[0].text for chunk in stream)

    try:
        threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        running.stop()
    alone = api.load(artifact, backend)
    assert answers == {prompt: reference(alone, prompt, 12).text for prompt in prompts}


@pytest.mark.parametrize("backend", EXPORTED)
def test_requests_admitted_together_share_each_step(artifact, backend, monkeypatch):
    """Four plain requests queued before the worker starts: every step of theirs is one batched call of four."""
    from streamfuse.runtime.request import batch

    sizes: list[int] = []
    real = batch.batched_step

    def counting(items, shape, scratch):
        sizes.append(len(items))
        return real(items, shape, scratch)

    monkeypatch.setattr(batch, "batched_step", counting)
    model = api.load(artifact, backend)
    scheduler = Scheduler(model.loaded, max_sequences=4, queue_size=4)
    loop = asyncio.new_event_loop()
    settings = frontend.decode_settings(
        model.loaded, frontend.DecodeRequest(max_new_tokens=8, method=frontend.BASELINE_METHOD)
    )
    prompts = [PROMPT, "what time is it", "they said you are not there", "how many people"]
    jobs = [ServerSlot(model.tokenizer(p, add_special_tokens=False)["input_ids"], settings, loop) for p in prompts]
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()

    async def results() -> list:
        return [await last_event(job) for job in jobs]

    try:
        finished = loop.run_until_complete(asyncio.wait_for(results(), 120))
    finally:
        scheduler.close()
        loop.close()
    assert sizes and set(sizes) == {4} and scheduler.active == 0
    alone = api.load(artifact, backend)
    for prompt, done in zip(prompts, finished):
        ids = alone.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert done.completion.token_ids == alone.generate(ids, 8, method=frontend.BASELINE_METHOD).token_ids


async def last_event(slot: ServerSlot) -> Finished:
    while not isinstance(event := await slot.events.get(), Finished):
        assert isinstance(event, Delta), event
    return event


def test_a_full_queue_is_a_503_at_once(loaded):
    stalled = serve(loaded, lifespan="off", max_sequences=1, queue=1)  # no scheduler thread: nothing leaves the queue
    try:
        settings = frontend.decode_settings(loaded.loaded, frontend.DecodeRequest(max_new_tokens=4))
        stalled.scheduler.submit(ServerSlot([5, 6], settings, loop=None))
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            stalled.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503 and time.monotonic() - started < 10
        assert "queue" in refused.value.body["message"] and "\n" not in refused.value.body["message"]
    finally:
        stalled.stop()
