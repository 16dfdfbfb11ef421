"""The fault probes of `streamfuse load-test` (tools/load_test.py): each bad input or bad client once, from outside.

    probes = run_probes(Target("127.0.0.1", 8000, key), pid, fault=True)

Each probe sends one thing a client may get wrong or do badly (a 10 MB body, NaN, JSON nested 100,000 deep, a
5,000-digit integer, wrong types, a wrong model, a wrong key, a foreign Origin or Host, a text/plain body, a
client that stalls reading, one that leaves a non-streamed request, a fault injected in one lane of a batch) and
checks the answer: the status it must get, one line, and that the server still serves after it. The 10 MB body is
sent while /health is polled (its slowest answer) and the server's RSS read before and after (with a pid).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

BIG_BODY = 10 << 20
HEALTH_BOUND = 1.0  # seconds /health may take while a big body comes
RSS_BOUND = 100 << 20  # bytes the big body may leave behind


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    key: str | None = None

    def call(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None, timeout=120):
        """(status, body bytes); headers with None values are left out."""
        sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        sent.update(headers or {})
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request(method, path, data, {k: v for k, v in sent.items() if v is not None})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def raw(self, body: dict) -> socket.socket:
        """A completion request on a socket of its own, its answer left unread."""
        data = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
        head += (f"Authorization: Bearer {self.key}\r\n" if self.key else "") + f"Content-Length: {len(data)}\r\n\r\n"
        sock = socket.create_connection((self.host, self.port))
        sock.sendall(head.encode() + data)
        return sock

    def idle(self, seconds: float) -> bool:
        """Whether the server decodes nothing and queues nothing within `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            health = json.loads(self.call("GET", "/health")[1])
            if health["active"] == 0 and health["queued"] == 0:
                return True
            time.sleep(0.05)
        return False


@dataclass
class Probe:
    name: str
    expected: str
    got: str = ""
    problem: str = ""


@dataclass
class Probes:
    probes: list[Probe] = field(default_factory=list)
    health_seconds: float | None = None  # the slowest /health during the big body
    rss_delta: int | None = None  # bytes the big body left in the server

    @property
    def problems(self) -> list[Probe]:
        return [probe for probe in self.probes if probe.problem]

    def markdown(self) -> str:
        lines = ["| probe | expected | got | ok |", "|---|---|---|---|"]
        lines += [
            f"| {p.name} | {p.expected} | {p.got} | {'no: ' + p.problem if p.problem else 'yes'} |" for p in self.probes
        ]
        if self.health_seconds is not None:
            lines.append(f"\n10 MB body: /health answered within {self.health_seconds * 1000:.0f} ms while it came")
        if self.rss_delta is not None:
            lines[-1] += f"; server RSS {self.rss_delta / 2**20:+.1f} MiB after it"
        return "\n".join(lines)


def expect(probe: Probe, answer: tuple[int, bytes], status: int, empty: bool = False) -> Probe:
    """The answer must have `status` and an error of one line in OpenAI's shape (or no body at all)."""
    got, body = answer
    probe.got = str(got)
    if got != status:
        probe.problem = f"status {got}: {body[:80]!r}"
    elif empty:
        probe.problem = "" if body == b"" else f"a body of {len(body)} bytes"
    else:
        try:
            message = json.loads(body)["error"]["message"]
            probe.problem = "" if "\n" not in message else "a message of several lines"
        except (ValueError, KeyError, TypeError):
            probe.problem = f"not an OpenAI error: {body[:80]!r}"
    return probe


BAD = (  # name, path, body, headers, status
    ("NaN temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', {}, 400),
    ("JSON 100,000 deep", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("5,000-digit integer", "/v1/completions", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", {}, 400),
    ('"messages": 5', "/v1/chat/completions", b'{"messages": 5}', {}, 400),
    ("wrong model", "/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', {}, 404),
    ("text/plain body", "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, 415),
    ("bad Host", "/v1/completions", b'{"prompt": "hi"}', {"Host": "rebound.example"}, 421),
)


def bad_inputs(target: Target) -> list[Probe]:
    probes = [
        expect(Probe(name, str(status)), target.call("POST", path, body, headers), status)
        for name, path, body, headers, status in BAD
    ]
    origin = target.call("POST", "/v1/completions", {"prompt": "hi"}, {"Origin": "http://evil.example"})
    probes.append(expect(Probe("foreign Origin", "403, no body"), origin, 403, empty=True))
    if target.key:
        wrong = target.call("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        probes.append(expect(Probe("wrong API key", "401"), wrong, 401))
    return probes


def big_body(target: Target, pid: int | None) -> tuple[Probe, float, int | None]:
    """A 10 MB body, /health polled meanwhile: (its probe, the slowest /health, the RSS it left)."""
    before, waits, done = rss(pid), [], threading.Event()

    def poll() -> None:
        while not done.is_set():
            started = time.perf_counter()
            target.call("GET", "/health", timeout=10)
            waits.append(time.perf_counter() - started)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        body = b'{"prompt": "' + b"the " * (BIG_BODY // 4) + b'"}'
        probe = expect(Probe("10 MB body", "413"), target.call("POST", "/v1/completions", body), 413)
    finally:
        done.set()
        poller.join()
    slowest, after = max(waits, default=0.0), rss(pid)
    delta = None if before is None else after - before
    if not probe.problem and (slowest > HEALTH_BOUND or (delta or 0) > RSS_BOUND):
        probe.problem = f"/health took {slowest:.2f} s, RSS {(delta or 0) / 2**20:+.0f} MiB"
    return probe, slowest, delta


def context_tokens(target: Target) -> int:
    """Tokens a completion of "hi" may ask for, read from the server's own over-context refusal."""
    message = target.call("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10**9})[1].decode()
    found = re.search(r"context of (\d+) positions", message)
    return max(1, int(found.group(1)) - 80) if found else 64


def bad_clients(target: Target, max_tokens: int) -> list[Probe]:
    """A client that leaves a long non-streamed request, and one that stalls reading a stream."""
    leaving = Probe("client leaves a non-streamed request", "lane freed within 1.5 s")
    sock = target.raw({"prompt": "what time is it", "max_tokens": context_tokens(target)})
    time.sleep(0.2)
    sock.close()
    leaving.got = "freed" if target.idle(1.5) else "still decoding"
    leaving.problem = "" if leaving.got == "freed" else "its lane still decodes 1.5 s after it left"
    stalled = Probe("client stalls reading a stream", "others served, lane freed")
    sock = target.raw({"prompt": "what time is it", "max_tokens": max_tokens, "stream": True})
    try:
        other = target.call("POST", "/v1/completions", {"prompt": "how are you", "max_tokens": max_tokens})
        stalled.got = f"{other[0]}, {'freed' if target.idle(30) else 'held'}"
        stalled.problem = "" if stalled.got == "200, freed" else "the others waited or the lane stayed held"
    finally:
        sock.close()
    return [leaving, stalled]


def worker_fault(target: Target, max_tokens: int) -> Probe:
    """Three requests at once, one of which faults after two steps: it fails in one line, the others finish."""
    probe = Probe("worker fault in one lane mid-batch", "500 for it, 200 for the others and after")
    bodies = [{"prompt": prompt, "max_tokens": max_tokens} for prompt in ("what time is it", "how are you", "the way")]
    bodies[1]["streamfuse_fault_after"] = 2
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda body: target.call("POST", "/v1/completions", body), bodies))
    after = target.call("POST", "/v1/completions", {"prompt": "what time is it", "max_tokens": max_tokens})
    statuses = [status for status, _ in answers] + [after[0]]
    probe.got = ", ".join(map(str, statuses))
    if statuses != [200, 500, 200, 200]:
        probe.problem = f"statuses {probe.got}"
    elif "\n" in json.loads(answers[1][1])["error"]["message"]:
        probe.problem = "the fault's message has several lines"
    return probe


def run_probes(target: Target, pid: int | None, max_tokens: int, fault: bool) -> Probes:
    probe, slowest, delta = big_body(target, pid)
    result = Probes([probe, *bad_inputs(target), *bad_clients(target, max_tokens)], slowest, delta)
    if fault:
        result.probes.append(worker_fault(target, max_tokens))
    alive = Probe("serves after the probes", "200")
    answer = target.call("POST", "/v1/completions", {"prompt": "what time is it", "max_tokens": 4})
    alive.got, alive.problem = str(answer[0]), "" if answer[0] == 200 else f"status {answer[0]}"
    result.probes.append(alive)
    return result


def rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def metrics_problems(target: Target) -> list[str]:
    """What a /metrics scrape lacks of the histograms and gauges it must carry after traffic."""
    status, body = target.call("GET", "/metrics")
    if status != 200:
        return [f"/metrics answered {status}"]
    text, missing = body.decode(), []
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "accepted_tokens_per_step"):
        found = re.search(rf"^streamfuse_{histogram}_count (\d+)", text, re.M)
        if found is None or int(found.group(1)) == 0:
            missing.append(f"/metrics: no streamfuse_{histogram} observations")
    for name in (
        "streamfuse_requests_total{",
        "streamfuse_lanes_busy ",
        "streamfuse_queue_depth ",
        "plain_steps_total ",
    ):
        if name not in text:
            missing.append(f"/metrics: no {name.strip(' {')}")
    return missing
