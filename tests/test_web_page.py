"""The chat page `streamfuse serve` answers at `/` (apps/web_page.py, apps/web/), driven in headless Chromium.

Chromium runs over the DevTools protocol (its websocket, the `websockets` client): the test types a message,
clicks Send and reads the page. Against the real server on the tiny model, the streamed answer equals the server's
non-streamed one, turn after turn, with accepted drafts and verified tokens marked and the figures shown (the page
loads without the server's API key and asks for it); against a scripted stream, the page ignores keep-alive
comments, shows model text as text and shows one-line errors. The routes themselves are checked with starlette's
TestClient. Without Chromium the browser tests skip (.ci/run installs it). STREAMFUSE_WEB_SCREENSHOT=docs/img/web.png
saves the page after its answers (the README's picture).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="the server extra (pip install 'streamfuse[server]')")
uvicorn = pytest.importorskip("uvicorn", reason="the server extra (pip install 'streamfuse[server]')")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from streamfuse.apps import web_page  # noqa: E402

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
STORY = "tell me a story"  # the tiny model's drafts are accepted on it (1.8 per step)


# --- the routes ----------------------------------------------------------------------------------


def test_the_routes_serve_the_page_its_files_and_nothing_else():
    client = TestClient(Starlette(routes=web_page.routes()))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["cache-control"] == "no-cache" and '<script src="/web/app.js"' in page.text
    script = client.get("/web/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert "innerHTML" not in script.text.replace("never innerHTML", "")
    assert client.get("/web/style.css").headers["content-type"].startswith("text/css")
    for path in ("/web/../server.py", "/web/..%2fserver.py", "/web/web_page.py", "/web/", "/web/%2e%2e"):
        assert client.get(path).status_code == 404, path


def test_the_page_fetches_nothing_from_outside():
    for name in web_page.FILES:
        text = (web_page.WEB / name).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
        assert "<script>" not in text and " style=" not in text, name  # no inline code: the CSP forbids it


# --- a browser over the DevTools protocol ---------------------------------------------------------


class Browser:
    """Headless Chromium and one page of it, driven over the DevTools protocol."""

    def __init__(self, profile: Path):
        from websockets.sync.client import connect

        flags = ["--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}", "--no-first-run"]
        flags += ["--no-default-browser-check", "--disable-gpu", "--disable-extensions", "--window-size=900,520"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to sandbox as root (CI containers)
        self.log = profile / "chromium.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([CHROMIUM, *flags, "about:blank"], stdout=log, stderr=log)
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 30
        while not port_file.exists() or len(port_file.read_text().split()) < 2:
            assert self.process.poll() is None, f"chromium exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.05)
        port, path = port_file.read_text().split()[:2]
        self.closing = contextlib.ExitStack()
        self.socket = self.closing.enter_context(connect(f"ws://127.0.0.1:{port}{path}", max_size=None, proxy=None))
        self.next_id, self.session, self.problems = 0, None, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=900, height=520, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session:
            message["sessionId"] = self.session
        self.socket.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.socket.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if reply.get("id") == self.next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]
            self.note(reply)

    def note(self, event: dict) -> None:
        """Keeps the page's script errors and console errors (a CSP violation is one)."""
        params = event.get("params", {})
        if event.get("method") == "Runtime.exceptionThrown":
            self.problems.append(params["exceptionDetails"].get("exception", {}).get("description", str(params)))
        elif event.get("method") == "Log.entryAdded" and params["entry"]["level"] == "error":
            if params["entry"].get("source") == "network":  # an error status the test asked for
                return
            self.problems.append(params["entry"]["text"])

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait(self, expression: str, seconds: float = 30):
        deadline = time.monotonic() + seconds
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"waited {seconds} s for: {expression}"
            time.sleep(0.05)
        return value

    def open(self, url: str) -> None:
        self.problems.clear()
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && document.body.dataset.state === 'idle'")

    def send(self, text: str, max_tokens: int, seconds: float = 45) -> dict:
        """Types `text`, clicks Send and waits for the answer's end; the page's state, last answer and figures."""
        self.evaluate(f"document.getElementById('max-tokens').value = '{max_tokens}'")
        self.evaluate("document.getElementById('prompt').focus()")
        self.call("Input.insertText", text=text)
        self.evaluate("document.getElementById('send').click()")
        self.wait("['done', 'error', 'stopped'].includes(document.body.dataset.state)", seconds)
        return self.evaluate(READ_PAGE)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.closing.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


READ_PAGE = """(() => {
  const answers = document.querySelectorAll('.turn.assistant .text');
  const last = answers[answers.length - 1];
  const figures = {};
  document.querySelectorAll('#stats .figure').forEach((f) => { figures[f.dataset.name] = f.firstChild.textContent; });
  return {
    state: document.body.dataset.state,
    text: last ? last.textContent : null,
    drafts: last ? [...last.querySelectorAll('.draft')].map((s) => s.textContent) : [],
    verified: last ? [...last.querySelectorAll('.verified')].map((s) => s.textContent) : [],
    elements: last ? last.querySelectorAll('*').length : 0,
    error: document.getElementById('error').hidden ? '' : document.getElementById('error').textContent,
    figures, stats: document.getElementById('stats').textContent,
    model: document.getElementById('model').textContent,
  };
})()"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    pytest.importorskip("websockets", reason="the dev extra's websocket client (drives Chromium)")
    running = Browser(tmp_path_factory.mktemp("chromium"))
    yield running
    running.close()


def serve(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    """The app on a free loopback port, uvicorn in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def stop(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=30)


# --- the page against the real server ------------------------------------------------------------


KEY = "sk-page-test"


@pytest.fixture(scope="module")
def served(checkpoint):
    """The real server on the tiny model, behind an API key (the page itself needs none)."""
    from streamfuse.apps.http_guard import Access
    from streamfuse.apps.server import create_app
    from streamfuse.runtime.request import api

    app = create_app(api.load(checkpoint / "ckpt"), "tiny", max_sequences=2, queue=4, access=Access(keys=(KEY,)))
    url, server, thread = serve(app)
    yield url
    stop(server, thread)


def whole(url: str, messages: list[dict], max_tokens: int) -> str:
    """The server's non-streamed answer to the same conversation."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode())
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


@needs_chromium
def test_the_page_streams_the_servers_answer_with_its_drafts_marked(browser, served):
    browser.open(f"{served}/")  # the page loads without the key; the API asks for it
    assert "API key" in browser.wait(
        "!document.getElementById('error').hidden && document.getElementById('error').textContent"
    )
    browser.evaluate(
        f"const key = document.getElementById('key'); key.value = '{KEY}'; key.dispatchEvent(new Event('change'))"
    )
    browser.wait("document.getElementById('model').textContent === 'tiny'")
    assert browser.evaluate("document.getElementById('error').hidden")
    first = browser.send(STORY, 32)
    assert first["state"] == "done" and not first["error"], first
    assert first["text"] == whole(served, [{"role": "user", "content": STORY}], 32) and first["text"]
    assert first["drafts"] and first["verified"], first  # SS speculates: both kinds of token are marked
    assert "".join(first["drafts"]) in first["text"]
    figures = first["figures"]
    assert float(figures["tokens/step"]) > 1 and float(figures["tokens/s"]) > 0 and int(figures["steps"]) > 1
    assert int(figures["tokens"]) == 32 and int(figures["accepted drafts"]) >= len(first["drafts"])
    second = browser.send("and then?", 16)  # the conversation goes with it
    history = [{"role": "user", "content": STORY}, {"role": "assistant", "content": first["text"]}]
    assert second["text"] == whole(served, [*history, {"role": "user", "content": "and then?"}], 16), second
    if os.environ.get("STREAMFUSE_WEB_SCREENSHOT"):
        browser.screenshot(Path(os.environ["STREAMFUSE_WEB_SCREENSHOT"]))
    assert not browser.problems, browser.problems  # no script error, nothing the CSP blocked
    with urllib.request.urlopen(f"{served}/", timeout=10) as page:  # the real server's page has the CSP too
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]


# --- the page against a scripted stream ----------------------------------------------------------


def scripted_app(seen: list[dict]):
    """The page's routes and a chat endpoint that answers a scripted stream per message: "ok" a marked answer
    with a keep-alive and an unmarked chunk, "refuse" a 400, "fail" an error mid-stream."""

    def chunk(text: str, step: dict | None = None, **extra) -> str:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": extra.pop("finish", None)}
        body = {"object": "chat.completion.chunk", "choices": [choice], **extra}
        if step:
            body["streamfuse_step"] = step
        return f"data: {json.dumps(body)}\n\n"

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        seen.append({"body": body, "authorization": request.headers.get("authorization")})
        said = body["messages"][-1]["content"]
        if said == "refuse":
            return JSONResponse({"error": {"message": "'max_tokens' is\n too large", "type": "x"}}, status_code=400)

        async def events():
            yield ": keep-alive\n\n"
            pieces = [{"text": "<b>bold?</b>", "draft": False}, {"text": " <img src=x>", "draft": True}]
            yield chunk("<b>bold?</b> <img src=x>", {"step": 1, "pieces": pieces, "rejected": 1, "plain": False})
            if said == "fail":
                yield 'data: {"error": {"message": "the engine failed", "type": "server_error"}}\n\n'
                return
            yield chunk(" unmarked")  # a server without streamfuse_step: plain text
            yield ": keep-alive\n\n"
            pieces = [{"text": "", "draft": True}, {"text": " end", "draft": False}]
            stats = {"new_tokens": 5, "steps": 1, "model_calls": 2, "seconds": 0.5, "time_to_first_token": 0.1}
            yield chunk(
                " end", {"step": 2, "pieces": pieces, "rejected": 0, "plain": True}, finish="stop", streamfuse=stats
            )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])]
    return Starlette(routes=[*web_page.routes(), *routes])


@needs_chromium
def test_the_page_marks_escapes_and_reports_errors_in_one_line(browser):
    seen: list[dict] = []
    url, server, thread = serve(scripted_app(seen))
    try:
        browser.open(f"{url}/")
        browser.wait("document.getElementById('model').textContent === 'scripted'")
        browser.evaluate("document.getElementById('key').value = 'sk-test'")
        answer = browser.send("ok", 7)
        assert answer["text"] == "<b>bold?</b> <img src=x> unmarked end" and answer["state"] == "done"
        assert answer["drafts"] == [" <img src=x>"] and answer["verified"] == ["<b>bold?</b>"]
        assert answer["elements"] == 3  # the three marked spans: the model's markup stayed text
        assert answer["figures"]["tokens/step"] == "2.50" and answer["figures"]["rejected drafts"] == "1"
        assert answer["figures"]["tokens/s"] == "10.0" and answer["figures"]["first token"] == "0.10 s"
        request = seen[-1]
        assert request["authorization"] == "Bearer sk-test" and request["body"]["max_tokens"] == 7
        assert request["body"]["stream"] is True and request["body"]["streamfuse_steps"] is True
        assert request["body"]["model"] == "scripted"

        refused = browser.send("refuse", 7)
        assert (refused["state"], refused["error"]) == ("error", "'max_tokens' is too large")
        failed = browser.send("fail", 7)
        assert (failed["state"], failed["error"]) == ("error", "the engine failed")
        browser.send("ok", 7)
        roles = [(m["role"], m["content"]) for m in seen[-1]["body"]["messages"]]
        assert roles == [("user", "ok"), ("assistant", answer["text"]), ("user", "ok")]  # failed turns left out
        assert not browser.problems, browser.problems
    finally:
        stop(server, thread)
