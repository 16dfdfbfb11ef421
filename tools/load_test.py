"""streamfuse load-test: many clients against `streamfuse serve`; every answer exact, the server's memory flat.

    streamfuse load-test --artifact artifacts/dialogsum --clients 16 --requests 20
    streamfuse load-test --url http://127.0.0.1:8000 --clients 16 --requests 20

N clients send M requests each, at once, mixing plain and streamed completions and chats, streams the client
drops after the first event, and malformed requests. First each distinct request is answered alone, one at a time:
its reference. Then the run checks that every well-formed answer is complete (a finish reason, usage) and equal to
its reference, text and token count; that every bad request gets a 4xx; and, with --artifact (the tool starts the
server on loopback itself and reads its /proc/<pid>/status), that the server's resident memory after the run is
within --max-growth of what it was after a warm-up round. Then /metrics must carry its histograms, and the fault
probes (tools/load_probes.py) send each bad input and bad client once: a 10 MB body (with /health's latency and the
RSS it left), NaN, deep JSON, huge integers, wrong types, a wrong model, key, Origin or Host, clients that stall
reading or leave, a fault injected in one lane of a batch (a server the tool starts runs with --fault-injection
and an API key of its own). Prints a markdown summary (--out: also to a file); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from streamfuse.runtime.commands import errors
from streamfuse.tools.load_probes import Probes, Target, metrics_problems, run_probes

PROMPTS = (  # words most vocabularies hold, so a tiny test model's tokenizer reads them too
    "what time is it",
    "the people said they will be there",
    "how many of them are in the house",
    "she said that it was not the way",
    "what do you make of this",
    "they were first in and first out",
)
MESSAGES = ({"role": "user", "content": "how are you"}, {"role": "user", "content": "what did he say"})
BAD_BODIES = (  # what a client may get wrong: each must be a 4xx
    b"{not json",
    b'{"prompt": 3}',
    b'{"prompt": "hi", "max_tokens": "many"}',
    b'{"prompt": "hi", "max_tokens": 10000000}',
    b'{"messages": "hi"}',
    b'{"prompt": "hi", "temperature": -1}',
)
KINDS = ("whole", "stream", "chat", "chat-stream", "disconnect", "malformed")
MAX_GROWTH = 0.05  # the resident memory the run may add after the warm-up round


@dataclass(frozen=True)
class Ask:
    """One request: its kind, the prompt (an index into PROMPTS or MESSAGES) or a bad body."""

    kind: str
    prompt: int = 0

    @property
    def chat(self) -> bool:
        return self.kind.startswith("chat")

    @property
    def key(self) -> tuple[bool, int]:
        """What its reference is: the same prompt answered alone, not streamed."""
        return self.chat, self.prompt % len(MESSAGES if self.chat else PROMPTS)

    def body(self, max_tokens: int) -> bytes:
        if self.kind == "malformed":
            return BAD_BODIES[self.prompt % len(BAD_BODIES)]
        body: dict = {"max_tokens": max_tokens, "stream": self.kind != "whole"}  # no model: the served one
        if self.chat:
            body["messages"] = [MESSAGES[self.prompt % len(MESSAGES)]]
            body["stream"] = self.kind == "chat-stream"
        else:
            body["prompt"] = PROMPTS[self.prompt % len(PROMPTS)]
        return json.dumps(body).encode()

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class Outcome:
    ask: Ask
    status: int
    text: str = ""
    finish: str | None = None
    tokens: int | None = None  # usage.completion_tokens
    seconds: float = 0.0
    problem: str = ""  # why the answer is wrong ("" when it is right)


def plan(clients: int, requests: int, seed: int, shares: dict[str, float]) -> list[list[Ask]]:
    """Each client's requests: kinds drawn by `shares`, prompts round-robin."""
    rng = random.Random(seed)
    kinds, weights = zip(*shares.items())
    return [
        [Ask(rng.choices(kinds, weights)[0], rng.randrange(len(PROMPTS))) for _ in range(requests)]
        for _ in range(clients)
    ]


# --- talking to the server -----------------------------------------------------------------------


class Client:
    def __init__(self, url: str, timeout: float = 600, key: str | None = None):
        parts = urlsplit(url)
        self.host, self.port, self.timeout, self.key = parts.hostname, parts.port or 80, timeout, key
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> dict:
        connection = self.connection()
        try:
            connection.request("GET", path, headers=self.headers)
            return json.loads(connection.getresponse().read())
        finally:
            connection.close()

    def send(self, ask: Ask, max_tokens: int) -> Outcome:
        started = time.perf_counter()
        connection = self.connection()
        try:
            connection.request("POST", ask.path, ask.body(max_tokens), self.headers)
            response = connection.getresponse()
            if response.status != 200 or ask.kind in ("whole", "chat"):
                outcome = whole(ask, response)
            else:
                outcome = streamed(ask, response)
        finally:
            connection.close()  # a "disconnect" ask leaves here after its first event
        outcome.seconds = time.perf_counter() - started
        return outcome


def whole(ask: Ask, response) -> Outcome:
    answer = json.loads(response.read() or b"{}")
    if response.status != 200:
        return Outcome(ask, response.status, answer.get("error", {}).get("message", ""))
    choice = answer["choices"][0]
    text = choice["message"]["content"] if ask.chat else choice["text"]
    return Outcome(ask, 200, text, choice.get("finish_reason"), answer.get("usage", {}).get("completion_tokens"))


def streamed(ask: Ask, response) -> Outcome:
    """Read server-sent events to `data: [DONE]` (a "disconnect" ask: only the first)."""
    outcome, parts = Outcome(ask, 200), []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            outcome.text = "".join(parts)
            return outcome
        chunk = json.loads(data)
        if "error" in chunk:
            outcome.problem = f"stream error: {chunk['error'].get('message')}"
            return outcome
        choice = chunk["choices"][0]
        parts.append((choice.get("delta", {}).get("content") or "") if ask.chat else choice.get("text", ""))
        outcome.finish = choice.get("finish_reason") or outcome.finish
        outcome.tokens = chunk.get("usage", {}).get("completion_tokens", outcome.tokens)
        if ask.kind == "disconnect":
            return outcome
    outcome.problem = "the stream ended without data: [DONE]"
    return outcome


def judge(outcome: Outcome, references: dict[tuple[bool, int], Outcome]) -> Outcome:
    """Set outcome.problem where the answer is not what it must be."""
    ask = outcome.ask
    if outcome.problem:
        return outcome
    if ask.kind == "malformed":
        if not 400 <= outcome.status < 500:
            outcome.problem = f"a malformed request got {outcome.status}, not a 4xx"
        return outcome
    if outcome.status != 200:
        outcome.problem = f"status {outcome.status}: {outcome.text}"
    elif ask.kind != "disconnect":
        reference = references[ask.key]
        if outcome.finish is None or outcome.tokens is None:
            outcome.problem = "incomplete: no finish reason or usage"
        elif (outcome.text, outcome.tokens) != (reference.text, reference.tokens):
            outcome.problem = (
                f"differs from its single-request answer: {outcome.text[:60]!r} != {reference.text[:60]!r}"
            )
    return outcome


# --- the server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, log) -> tuple[subprocess.Popen, str]:
    """`streamfuse serve` on loopback in a process of its own, with fault injection and args.api_key; returns it
    once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "streamfuse.cli", "serve", "--artifact", str(args.artifact), "--port", str(port)]
    command += ["--fault-injection", "--api-key", args.api_key]
    command += ["--backend", args.backend, "--max-sequences", str(args.max_sequences), "--queue", str(args.queue)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}: see {log.name}")
        try:
            Client(url, 5).get("/health")
            return process, url
        except OSError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"the server did not answer within {args.start_timeout} s: see {log.name}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no VmRSS")


def wait_idle(client: Client, seconds: float = 120) -> None:
    """Until the server decodes nothing and queues nothing (lanes of dropped streams freed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        health = client.get("/health")
        if health["active"] == 0 and health["queued"] == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the server still decodes {health} {seconds} s after the run")


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    rss: tuple[int, int] | None = None  # after the warm-up round, after the run
    max_growth: float = MAX_GROWTH
    probes: Probes | None = None
    metrics: list[str] = field(default_factory=list)  # what /metrics lacked after the run

    @property
    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    @property
    def growth(self) -> float | None:
        return None if self.rss is None else (self.rss[1] - self.rss[0]) / self.rss[0]

    @property
    def passed(self) -> bool:
        probed = self.probes is None or not self.probes.problems
        return (
            not self.problems and not self.metrics and probed and (self.growth is None or self.growth < self.max_growth)
        )

    def markdown(self) -> str:
        kinds = Counter(o.ask.kind for o in self.outcomes)
        bad = Counter(o.ask.kind for o in self.problems)
        lines = ["| kind | requests | wrong |", "|---|---|---|"]
        lines += [f"| {kind} | {kinds[kind]} | {bad[kind]} |" for kind in KINDS if kinds[kind]]
        tokens = sum(o.tokens or 0 for o in self.outcomes if o.ask.kind != "disconnect" and not o.problem)
        lines += ["", f"{len(self.outcomes)} requests in {self.seconds:.1f} s, {tokens / self.seconds:.1f} tokens/s"]
        if self.rss is not None:
            before, after = (value / 2**20 for value in self.rss)
            lines.append(
                f"server RSS: {before:.1f} MiB after the warm-up, {after:.1f} MiB after the run "
                f"({self.growth:+.2%}; at most {self.max_growth:.0%})"
            )
        lines += [f"- {o.ask.kind} #{o.ask.prompt}: {o.problem}" for o in self.problems[:20]]
        lines += [f"- {problem}" for problem in self.metrics]
        if self.probes is not None:
            lines += ["", self.probes.markdown()]
        lines.append(f"\n**{'passed' if self.passed else 'FAILED'}**")
        return "\n".join(lines)


def references(client: Client, asks: list[Ask], max_tokens: int) -> dict[tuple[bool, int], Outcome]:
    """Each distinct prompt answered alone, not streamed, one at a time."""
    found = {}
    for key in sorted({ask.key for ask in asks if ask.kind != "malformed"}):
        chat, prompt = key
        outcome = client.send(Ask("chat" if chat else "whole", prompt), max_tokens)
        if outcome.status != 200:
            raise RuntimeError(f"the reference request {key} got {outcome.status}: {outcome.text}")
        found[key] = outcome
    return found


def load(client: Client, asks: list[list[Ask]], max_tokens: int) -> list[Outcome]:
    """Every client's requests, the clients at once."""
    with ThreadPoolExecutor(len(asks)) as pool:
        done = pool.map(lambda mine: [client.send(ask, max_tokens) for ask in mine], asks)
        return [outcome for outcomes in done for outcome in outcomes]


def run(args: argparse.Namespace, url: str, pid: int | None) -> Report:
    client = Client(url, key=args.api_key)
    shares = dict(zip(KINDS, (args.whole, args.stream, args.chat, args.chat_stream, args.disconnect, args.malformed)))
    asks = plan(args.clients, args.requests, args.seed, shares)
    truth = references(client, [ask for mine in asks for ask in mine], args.max_tokens)
    load(client, [[Ask("whole", i)] for i in range(args.clients)], args.max_tokens)  # warm-up: every lane once
    wait_idle(client)
    before = rss_bytes(pid) if pid is not None else None
    started = time.perf_counter()
    outcomes = load(client, asks, args.max_tokens)
    report = Report([judge(o, truth) for o in outcomes], time.perf_counter() - started, max_growth=args.max_growth)
    target = Target(client.host, client.port, args.api_key)
    report.metrics = metrics_problems(target)
    wait_idle(client)
    if pid is not None:
        report.rss = (before, rss_bytes(pid))
    if args.probes:
        report.probes = run_probes(target, pid, args.max_tokens, fault=args.artifact is not None)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", default=None, help="a running server (http://host:port)")
    where.add_argument("--artifact", type=Path, default=None, help="start `streamfuse serve` on it, on loopback")
    parser.add_argument("--backend", default="auto", help="--artifact: the server's engine (default: auto)")
    parser.add_argument("--threads", type=int, default=None, help="--artifact: the server's engine threads")
    parser.add_argument("--max-sequences", type=int, default=8, help="--artifact: the server's lanes")
    parser.add_argument("--queue", type=int, default=64, help="--artifact: the server's queue")
    parser.add_argument("--clients", type=int, default=16, help="clients at once (default: 16)")
    parser.add_argument("--requests", type=int, default=20, help="requests per client (default: 20)")
    parser.add_argument("--max-tokens", type=int, default=32, help="each request's max_tokens")
    parser.add_argument("--seed", type=int, default=0, help="the mix of requests")
    for kind, share in zip(KINDS, (0.3, 0.25, 0.15, 0.1, 0.1, 0.1)):
        parser.add_argument(f"--{kind}", type=float, default=share, help=f"share of {kind} requests ({share})")
    parser.add_argument("--max-growth", type=float, default=MAX_GROWTH, help="RSS the run may add (0.05: 5 %%)")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds the server may take to load")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown summary here")
    parser.add_argument("--api-key", default=None, help="--url: the server's key (--artifact: a fresh one)")
    parser.add_argument("--no-probes", dest="probes", action="store_false", help="skip the fault probes")
    args = parser.parse_args(argv)
    if args.artifact is not None:
        args.api_key = secrets.token_urlsafe(16)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        raise errors.UsageError("--clients, --requests and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url is not None:
        report = run(args, args.url, None)
    else:
        with tempfile.NamedTemporaryFile("w", prefix="streamfuse-serve-", suffix=".log", delete=False) as log:
            process, url = start_server(args, log)
            try:
                report = run(args, url, process.pid)
            finally:
                process.terminate()
                process.wait(timeout=30)
    summary = report.markdown()
    print(summary)
    if args.out is not None:
        args.out.write_text(summary + "\n")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(errors.run(main))
