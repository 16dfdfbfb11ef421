"""`streamfuse serve` probed from outside over real HTTP on loopback: bounded inputs, keys, Host and Origin checks,
metrics, the model-name check, top_k and seed, stop strings of any length, the streamed steps the page reads.

Every bad request is a 4xx of one line in OpenAI's error shape and the server keeps serving; the worker's faults and
deadlines are tests/test_server_faults.py's."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

pytest.importorskip("starlette", reason="the server extra (pip install 'streamfuse[server]')")
pytest.importorskip("uvicorn", reason="the server extra (pip install 'streamfuse[server]')")
openai = pytest.importorskip("openai", reason="the dev extra's official client")

from streamfuse.apps import server as server_module  # noqa: E402
from streamfuse.apps.http_guard import Access  # noqa: E402
from streamfuse.apps.request_body import Limits  # noqa: E402
from streamfuse.runtime.commands import errors  # noqa: E402
from streamfuse.runtime.request import api  # noqa: E402
from streamfuse.runtime.request.frontend import BASELINE_METHOD  # noqa: E402

from test_server import PROMPT, reference, serve  # noqa: E402

KEY, OTHER_KEY = "key-one", "key-two"
ALLOWED = "http://allowed.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return api.load(checkpoint / "ckpt")


@pytest.fixture(scope="module")
def guarded(checkpoint):
    access = Access.for_server("127.0.0.1", (KEY, OTHER_KEY), (), (ALLOWED,))
    limits = Limits(max_prompt_chars=2000)
    running = serve(api.load(checkpoint / "ckpt"), max_sequences=4, queue=8, access=access, limits=limits)
    yield running
    running.stop()


def call(served, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, headers, body) of one request; a dict body is sent as JSON with the key, unless headers say else."""
    host, port = served.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    sent = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        connection.request(method, path, data, {k: v for k, v in sent.items() if v is not None})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def refused(status_body: tuple, status: int, words: str) -> dict:
    """The error of a refusal: the status, OpenAI's shape, one line naming the problem."""
    got, _, raw = status_body
    assert got == status, raw[:300]
    error = json.loads(raw)["error"]
    assert words in error["message"] and "\n" not in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    return error


DEEP = b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BAD = [
    (b'{"prompt": "hi", "temperature": NaN}', "NaN"),
    (b'{"prompt": "hi", "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "hi", "temperature": 1e999}', "must be finite"),
    (b'{"prompt": "hi", "seed": ' + b"7" * 5000 + b"}", "5000 digits"),
    (DEEP, "nests deeper than 32"),
    (b'{"prompt": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper than 32"),
    (b"\xff\xfe{}", "not UTF-8"),
    (json.dumps({"prompt": "hi", "top_k": -1}).encode(), "'top_k' must be >= 0"),
    (json.dumps({"prompt": "hi", "stop": ["a"] * 5}).encode(), "up to 4"),
    (json.dumps({"prompt": "hi", "stop": "x" * 129}).encode(), "at most 128 characters"),
    (json.dumps({"prompt": "the " * 600}).encode(), "at most 2000 fit"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), "'n' must be 1"),
    (json.dumps({"prompt": "hi", "model": 5}).encode(), "'model' must be a string"),
]


@pytest.mark.parametrize("body, words", BAD, ids=[words.split()[0] + str(i) for i, (_, words) in enumerate(BAD)])
def test_a_malformed_body_is_a_400_of_one_line(guarded, body, words):
    refused(call(guarded, "POST", "/v1/completions", body), 400, words)


CHAT_BAD = [
    ({"messages": 5}, "'messages' must be a list"),
    ({"messages": [5]}, "messages[0] must be an object"),
    ({"messages": [{"role": "user", "content": ["parts"]}]}, "messages[0]'s content must be a non-empty string"),
    ({"messages": [{"role": "user", "content": "x" * 2001}]}, "at most 2000 fit"),
]


@pytest.mark.parametrize("body, words", CHAT_BAD, ids=[str(i) for i in range(len(CHAT_BAD))])
def test_a_chat_body_of_wrong_types_is_a_400(guarded, body, words):
    refused(call(guarded, "POST", "/v1/chat/completions", body), 400, words)


def test_a_body_past_the_limit_is_a_413_and_health_answers_while_it_comes(guarded):
    waits: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            assert call(guarded, "GET", "/health")[0] == 200
            waits.append(time.perf_counter() - started)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        body = b'{"prompt": "' + b"the " * (10 << 18) + b'"}'  # 10 MiB
        error = refused(call(guarded, "POST", "/v1/completions", body), 413, "exceeds --max-body-bytes")
    finally:
        stop.set()
        poller.join()
    assert error["type"] == "invalid_request_error" and waits and max(waits) < 1.0


def test_only_json_bodies_are_read(guarded):
    for kind in ("text/plain", None, "application/json; charset=latin-1"):
        answer = call(guarded, "POST", "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": kind})
        refused(answer, 415, "Content-Type: application/json")


def test_a_wrong_model_is_a_404_and_unknown_fields_are_named_in_a_header(guarded, loaded):
    error = refused(call(guarded, "POST", "/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}), 404, "'gpt-4'")
    assert error["code"] == "model_not_found"
    body = {"prompt": PROMPT, "max_tokens": 6, "model": "tiny", "frequency_penalty": 1, "logit_bias": {}}
    status, headers, raw = call(guarded, "POST", "/v1/completions", body)
    assert status == 200 and headers["x-streamfuse-ignored-fields"] == "frequency_penalty, logit_bias"
    assert json.loads(raw)["choices"][0]["text"] == reference(loaded, PROMPT, 6).text
    status, headers, _ = call(guarded, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and "x-streamfuse-ignored-fields" not in headers  # no model named: fine


def test_the_key_is_needed_and_the_openai_client_works_with_it(guarded, loaded):
    assert call(guarded, "GET", "/v1/models", headers={"Authorization": None})[0] == 401
    status, headers, raw = call(guarded, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert call(guarded, "GET", "/metrics", headers={"Authorization": None})[0] == 401
    assert call(guarded, "GET", "/health", headers={"Authorization": None})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        guarded.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    for key in (KEY, OTHER_KEY):
        client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=key, max_retries=0)
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
        assert answer.choices[0].text == reference(loaded, PROMPT, 5).text


def test_beyond_loopback_the_server_needs_a_key(tmp_path):
    args = server_module.parse_args(["--artifact", str(tmp_path), "--host", "0.0.0.0"])
    with pytest.raises(errors.UsageError, match="give --api-key"):
        server_module.access_of(args)
    (tmp_path / "keys").write_text("# ours\nsecret\n")
    args = server_module.parse_args(
        ["--artifact", str(tmp_path), "--host", "0.0.0.0", "--api-key-file", str(tmp_path / "keys")]
    )
    assert server_module.access_of(args).keys == ("secret",)
    assert server_module.access_of(server_module.parse_args(["--artifact", str(tmp_path)])).keys == ()


def test_a_foreign_host_or_origin_gets_no_answer(guarded):
    port = guarded.url.rsplit(":", 1)[1]
    error = refused(call(guarded, "GET", "/v1/models", headers={"Host": f"evil.example:{port}"}), 421, "evil.example")
    assert error["code"] == "host_not_allowed"
    assert call(guarded, "GET", "/v1/models", headers={"Host": f"localhost:{port}"})[0] == 200
    status, _, raw = call(guarded, "POST", "/v1/completions", {"prompt": PROMPT}, {"Origin": "http://evil.example"})
    assert status == 403 and raw == b""
    assert call(guarded, "GET", "/health", headers={"Origin": "null"})[:3:2] == (403, b"")
    same = call(guarded, "GET", "/v1/models", headers={"Origin": guarded.url})  # the server's own page
    assert same[0] == 200 and "access-control-allow-origin" not in same[1]
    status, headers, _ = call(guarded, "GET", "/v1/models", headers={"Origin": ALLOWED})
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED


def test_a_preflight_answers_allowed_origins_only(guarded):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, raw = call(guarded, "OPTIONS", "/v1/chat/completions", headers={**ask, "Origin": ALLOWED})
    assert status == 204 and raw == b"" and headers["access-control-allow-origin"] == ALLOWED
    assert "Authorization" in headers["access-control-allow-headers"]
    status, _, raw = call(guarded, "OPTIONS", "/v1/chat/completions", headers={**ask, "Origin": "http://evil.example"})
    assert (status, raw) == (403, b"")


def test_top_k_and_seed_are_honoured(guarded, loaded):
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)

    def ask(**extra) -> str:
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, **extra)
        return answer.choices[0].text

    greedy = reference(loaded, PROMPT, 16).text
    assert ask(extra_body={"top_k": 1}) == greedy  # top_k 1 keeps only the argmax: any seed draws it
    ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    drawn = {seed: ask(seed=seed) for seed in (1, 2, 3)}
    for seed, text in drawn.items():
        assert text == loaded.generate(ids, 16, temperature=1.0, seed=seed).text
    assert len(set(drawn.values())) > 1 and ask(seed=2) == drawn[2]


def test_a_stop_string_longer_than_sixteen_tokens_stops_the_generation(guarded, loaded):
    tokens = reference(loaded, PROMPT, 60).token_ids
    start, end = longest_run(tokens, set(loaded.tokenizer.all_special_ids))  # words only: the stop's text is theirs
    assert end - start > 16
    stop = loaded.tokenizer.decode(tokens[start:end])
    answer = guarded_client(guarded).completions.create(model="tiny", prompt=PROMPT, max_tokens=60, stop=[stop])
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == end
    assert (
        answer.choices[0].text == reference(loaded, PROMPT, 60, stop=(stop,)).text
        and stop not in answer.choices[0].text
    )
    ids = loaded.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    plain = loaded.generate(ids, 60, method=BASELINE_METHOD, stop=(stop,))
    speculative = loaded.generate(ids, 60, stop=(stop,))
    assert plain.token_ids == speculative.token_ids == tokens[:end] and plain.stop_reason == "stop_string"


def longest_run(tokens: list[int], special: set[int]) -> tuple[int, int]:
    """[start, end) of the longest run of tokens none of which is special."""
    best, start = (0, 0), 0
    for index, token in enumerate([*tokens, None]):
        if token is None or token in special:
            best = max(best, (start, index), key=lambda run: run[1] - run[0])
            start = index + 1
    return best


def guarded_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)


def stream_chunks(served, body: dict) -> list[dict]:
    status, _, raw = call(served, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    lines = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def content(chunks: list[dict]) -> str:
    return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)


def test_streamed_steps_mark_each_token_and_join_to_the_text(guarded, loaded):
    body = {"messages": [{"role": "user", "content": "how are you"}], "max_tokens": 24}
    marked = stream_chunks(guarded, {**body, "streamfuse_steps": True})
    plain = stream_chunks(guarded, body)
    assert not any("streamfuse_step" in chunk for chunk in plain)
    assert content(marked) == content(plain) == reference(loaded, "", 24, chat=True).text
    steps = [chunk["streamfuse_step"] for chunk in marked if "streamfuse_step" in chunk]
    assert [step["step"] for step in steps] == list(range(1, len(steps) + 1))
    for chunk in marked[1:-1]:  # every step's chunk: its pieces join to its text; drafts come first
        step, delta = chunk["streamfuse_step"], chunk["choices"][0]["delta"].get("content") or ""
        assert "".join(piece["text"] for piece in step["pieces"]) == delta
        flags = [piece["draft"] for piece in step["pieces"]]
        assert flags == sorted(flags, reverse=True) and step["rejected"] >= 0
    assert sum(len(step["pieces"]) for step in steps) == marked[-1]["usage"]["completion_tokens"]
    assert "streamfuse_step" not in marked[-1] and marked[-1]["choices"][0]["finish_reason"]


def test_metrics_carry_the_histograms_after_traffic(guarded):
    guarded_client(guarded).completions.create(model="tiny", prompt=PROMPT, max_tokens=12)
    status, headers, raw = call(guarded, "GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['streamfuse_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "accepted_tokens_per_step"):
        assert values[f'streamfuse_{histogram}_bucket{{le="+Inf"}}'] == values[f"streamfuse_{histogram}_count"] > 0
        assert "# TYPE streamfuse_" + histogram + " histogram" in text
    assert values["streamfuse_generated_tokens_total"] >= 12
    for gauge in ("lanes_busy", "queue_depth", "plain_steps_total", "worker_up"):
        assert f"streamfuse_{gauge}" in values
    assert values["streamfuse_worker_up"] == 1
