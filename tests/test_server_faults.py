"""`streamfuse serve`'s supervised worker, from outside over HTTP on loopback: a fault fails only the request that
caused it, a dead worker is replaced (or /health says why not), deadlines end stuck requests in one line, streams
get keep-alives, clients that leave or stall free their lanes, and cached prefixes stay within a key."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the server extra (pip install 'streamfuse[server]')")
pytest.importorskip("uvicorn", reason="the server extra (pip install 'streamfuse[server]')")
openai = pytest.importorskip("openai", reason="the dev extra's official client")

from streamfuse.apps import server as server_module  # noqa: E402
from streamfuse.apps.http_guard import Access  # noqa: E402
from streamfuse.apps.request_body import Limits  # noqa: E402
from streamfuse.runtime.request import api, decode  # noqa: E402

from test_server import PROMPT, reference, serve, wait_idle  # noqa: E402
from test_server_guard import KEY, OTHER_KEY, call  # noqa: E402

PROMPTS = [PROMPT, "what time is it", "they said you are not there", "how many people"]


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return api.load(checkpoint / "ckpt")


@pytest.fixture(scope="module")
def served(checkpoint):
    access = Access(keys=(KEY, OTHER_KEY))
    running = serve(
        api.load(checkpoint / "ckpt"), max_sequences=4, queue=8, access=access, limits=Limits(fault_injection=True)
    )
    yield running
    running.stop()


def client(served, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)


def slow_steps(monkeypatch, served, seconds: float) -> None:
    decoder = served.scheduler.decoder
    step = decoder.step

    def slow():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(decoder, "step", slow)


def ask_all(served, prompts: list[str], max_tokens: int, extra: dict[str, dict] | None = None) -> dict:
    """Each prompt asked at once; prompt -> its text, or the APIStatusError it raised."""
    answers: dict[str, object] = {}

    def ask(prompt: str) -> None:
        try:
            answer = client(served).completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body=(extra or {}).get(prompt)
            )
            answers[prompt] = answer.choices[0].text
        except openai.APIStatusError as error:
            answers[prompt] = error

    threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return answers


def one_line_500(error: object, words: str) -> None:
    assert isinstance(error, openai.APIStatusError) and error.status_code == 500, error
    assert words in error.body["message"] and "\n" not in error.body["message"]


def test_an_engine_fault_in_one_lane_fails_that_request_only(served, loaded, monkeypatch):
    bad = loaded.tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
    forward = decode.Generation.forward
    calls = []

    def failing(self, planned):  # its third engine call fails: the lane is mid-decode among the others
        if self.prompt_ids == bad:
            calls.append(planned)
            if len(calls) == 3:
                raise RuntimeError("the engine broke")
        return forward(self, planned)

    monkeypatch.setattr(decode.Generation, "forward", failing)
    answers = ask_all(served, PROMPTS, 12)
    monkeypatch.undo()
    one_line_500(answers.pop(PROMPTS[1]), "this request's decode failed (RuntimeError: the engine broke)")
    assert answers == {prompt: reference(loaded, prompt, 12).text for prompt in answers}
    wait_idle(served)
    assert client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_a_fault_injected_mid_batch_fails_its_request_and_the_others_finish(served, loaded):
    answers = ask_all(served, PROMPTS, 12, {PROMPTS[2]: {"streamfuse_fault_after": 3}})
    one_line_500(answers.pop(PROMPTS[2]), "InjectedFault")
    assert answers == {prompt: reference(loaded, prompt, 12).text for prompt in answers}
    assert call(served, "GET", "/health")[0] == 200


def test_a_fault_outside_the_step_fails_that_cycles_requests_and_the_worker_goes_on(served, monkeypatch):
    scheduler, faults = served.scheduler, served.scheduler.faults
    drop = scheduler._drop_ended
    raised = []

    def once():
        if not raised and scheduler.slots:
            raised.append(1)
            raise KeyError("a bug")
        drop()

    monkeypatch.setattr(scheduler, "_drop_ended", once)
    one_line_500(ask_all(served, [PROMPT], 12)[PROMPT], "the server failed this request's step (KeyError")
    assert scheduler.faults == faults + 1 and scheduler.restarts == 0 and scheduler.thread.is_alive()
    assert client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_a_dead_worker_is_replaced(served, monkeypatch):
    scheduler = served.scheduler
    step, died = scheduler._step, []

    def dying():
        if not died:
            died.append(1)
            raise SystemExit("pulled out")
        step()

    monkeypatch.setattr(scheduler, "_step", dying)
    one_line_500(ask_all(served, [PROMPT], 12)[PROMPT], "the worker stopped: SystemExit: pulled out")
    status, _, raw = call(served, "GET", "/health")
    assert status == 200 and json.loads(raw)["restarts"] == 1
    assert client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_past_its_restarts_the_server_says_it_is_unhealthy_and_refuses_work(loaded, monkeypatch):
    running = serve(loaded, max_restarts=0)
    try:

        def dying():
            raise SystemExit("gone")

        monkeypatch.setattr(running.scheduler, "_step", dying)
        one_line_500(ask_all(running, [PROMPT], 8)[PROMPT], "SystemExit: gone")
        status, _, raw = call(running, "GET", "/health")
        assert status == 503 and "SystemExit: gone" in json.loads(raw)["reason"]
        with pytest.raises(openai.APIStatusError) as refused:
            client(running).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert refused.value.status_code == 503 and "unhealthy" in refused.value.body["message"]
    finally:
        running.stop()


def test_a_deadline_ends_a_request_in_one_line(served, monkeypatch):
    monkeypatch.setattr(served.app.state.server, "timeout", 1.0)
    slow_steps(monkeypatch, served, 0.05)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as late:
        client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=200)
    assert late.value.status_code == 504 and "deadline of 1 s" in late.value.body["message"]
    assert time.monotonic() - started < 3
    status, _, raw = call(served, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "stream": True})
    events = [line for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "data: [DONE]" and "deadline of 1 s" in events[-2]
    wait_idle(served)


def test_a_stuck_step_cannot_hold_a_request_past_its_deadline(served, monkeypatch):
    monkeypatch.setattr(served.app.state.server, "timeout", 0.5)
    monkeypatch.setattr(server_module, "DEADLINE_GRACE", 0.5)
    slow_steps(monkeypatch, served, 3.0)  # the worker is stuck in a step longer than the deadline
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as late:
        client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=50)
    assert late.value.status_code == 504 and time.monotonic() - started < 2.5
    monkeypatch.undo()
    wait_idle(served)


def test_a_quiet_stream_gets_keep_alive_comments(served, monkeypatch):
    monkeypatch.setattr(served.app.state.server, "keepalive", 0.05)
    slow_steps(monkeypatch, served, 0.25)
    status, _, raw = call(served, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True})
    assert status == 200 and ": keep-alive\n\n" in raw.decode() and raw.decode().endswith("data: [DONE]\n\n")


def raw_request(served, body: dict) -> socket.socket:
    """A request sent on a socket of its own, its answer left unread."""
    host, port = served.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def test_a_client_gone_from_a_non_streamed_request_frees_its_lane_at_once(served, monkeypatch):
    slow_steps(monkeypatch, served, 0.02)  # 500 tokens take 10 s: the lane decodes when its client leaves
    dropped = served.scheduler.dropped
    sock = raw_request(served, {"prompt": PROMPT, "max_tokens": 200})
    deadline = time.monotonic() + 10
    while served.scheduler.active == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    left = time.monotonic()
    wait_idle(served, 2)
    assert served.scheduler.dropped == dropped + 1 and time.monotonic() - left < 1.5


def test_a_client_that_stalls_reading_holds_no_lane(served, loaded):
    stalled = raw_request(served, {"prompt": PROMPT, "max_tokens": 30, "stream": True})
    try:
        assert ask_all(served, [PROMPTS[1]], 8)[PROMPTS[1]] == reference(loaded, PROMPTS[1], 8).text
        wait_idle(served, 10)  # the stalled stream's answer sits in the socket's buffers, its lane free
        assert served.scheduler.active == 0
    finally:
        stalled.close()


def prefilled(served, key: str) -> tuple[int, int]:
    answer = client(served, key).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    return answer.model_extra["streamfuse"]["prefill_tokens"], answer.usage.prompt_tokens


def test_a_cached_prefix_serves_only_its_own_key(served, monkeypatch):
    wait_idle(served)
    monkeypatch.setattr(served.scheduler, "max_sequences", 1)  # one lane: each request takes the last one's cache
    server = served.app.state.server
    monkeypatch.setattr(server, "isolation", "key")
    prefilled(served, KEY)
    shared, prompt = prefilled(served, KEY)
    assert shared < prompt  # the same key: its prefix is kept
    assert prefilled(served, OTHER_KEY) == (prompt, prompt)  # another key: all prefilled, nothing learnt
    monkeypatch.setattr(server, "isolation", "request")
    assert prefilled(served, OTHER_KEY) == prefilled(served, OTHER_KEY) == (prompt, prompt)
    monkeypatch.setattr(server, "isolation", "none")
    prefilled(served, OTHER_KEY)
    assert prefilled(served, KEY)[0] < prompt  # no isolation: any request's prefix serves the next
