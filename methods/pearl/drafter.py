"""PEARL's drafter (Liu et al. 2024): sd's draft model (methods/sd) drafts in its own process, on its own core,
while the target verifies, so neither waits for the other.

    worker (draft model, 1 thread, pinned to the last core): drafts the next token, again and again, up to
             2 gamma + 1 past the confirmed text; between calls it reads the host's commit / reset messages
    host:    post-verify: propose(root) takes the worker's gamma drafts after root (ready: they were drafted
             during the previous verify) and the target verifies them while the worker drafts on;
             pre-verify (after a miss): the target takes a plain step on the root while the worker drafts
             from it, and the worker's first draft is checked against the target's token.
    observe: all gamma accepted and the worker's next draft is the target's correction -> stay post-verify
             (the drafts after it are still good); otherwise reset the worker to the accepted text + the
             correction (its cache rolls back) and go pre-verify.

The host alone decides; the worker's drafts are a function of the confirmed text (greedy: its argmax; sampling:
a draw from q seeded by (seed, epoch, position)), so outputs and the step structure do not depend on timing, and
every message is checked against the host's view (positions and epochs), so a worker that drifted is an error,
not a wrong token. Greedy outputs are plain decoding's; sampled chains are accepted by speculative sampling
against q. One deviation from the paper: pre-verify accepts the worker's first draft when it equals the target's
sampled token (the paper accepts with probability min(1, p/q)), which keeps sampling exact with the loop's plain
step, at a lower acceptance under sampling; greedy is the paper's rule.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from streamfuse.runtime.backends.base import StepOutput
from streamfuse.runtime.request.drafter import Draft
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.sampling import SamplingConfig, draw, target_probs

WORKER_START_SECONDS = 300  # loading the draft model in a fresh interpreter (torch import included)


def worker_core() -> int | None:
    """The core the worker is pinned to: the last this process may use (None: pinning unsupported or one core)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1] if len(cores) > 1 else None


class PearlWorker:
    """The draft model in a child process: spawned once, serving every run (`start`). `load` is the runtime
    loader's load (runtime/request/loader.py; module-level, so the child can be handed it): the child opens `folder`
    with it."""

    def __init__(self, folder: Path, engine: str, load: Callable, device: str = "cpu"):
        context = multiprocessing.get_context("spawn")  # no fork of a process that holds engine threads
        self.connection, child = context.Pipe()
        self.core = worker_core()
        self.process = context.Process(
            target=serve, args=(child, str(folder), engine, device, self.core, load), daemon=True
        )
        self.process.start()
        child.close()
        if not self.connection.poll(WORKER_START_SECONDS):
            self.close()
            raise RuntimeError(
                f"PEARL's draft worker did not load {folder} on {engine} within {WORKER_START_SECONDS} s"
            )
        message = self.connection.recv()
        if message[0] != "ready":
            self.close()
            raise RuntimeError(f"PEARL's draft worker failed to load {folder} on {engine}: {message[1]}")
        self.name = message[1]
        # Drafts carry the epoch they were made in: a new one at every reset and every run (drafters come and
        # go, the worker stays), so what it sent before and nobody read is known stale.
        self.epoch = 0

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def send(self, *message) -> None:
        self.connection.send(message)

    def receive(self) -> tuple:
        message = self.connection.recv()
        if message[0] == "error":
            raise RuntimeError(f"PEARL's draft worker failed: {message[1]}")
        return message

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


class PearlDrafter:
    uses_streams = False
    name = "pearl"

    def __init__(self, worker: PearlWorker, settings: DecodeSettings):
        if settings.method != self.name:
            raise ValueError(f"this drafter drafts for method pearl, not {settings.method!r}")
        self.worker, self.tree, self.gamma = worker, settings.tree, settings.tree.depth  # a chain (DecodeSettings)
        self.sampling, self.seed = settings.sampling, settings.seed
        self.confirmed = 0  # tokens the target has emitted or been given (prompt + output); the root is the last
        self.capacity = 0  # positions the worker drafts up to (the run's)
        self.drafts: dict[int, tuple[int, np.ndarray | None]] = {}  # position -> (token, q) of this epoch
        self.post = False  # post-verify: the worker's drafts after the root are good

    def start(self, prompt_ids: Sequence[int], prefill: StepOutput, root: int, capacity: int) -> int:
        self.confirmed, self.drafts, self.post, self.capacity = len(prompt_ids) + 1, {}, False, capacity
        # capacity holds the prompt, every new token and one verify of gamma + 1 rows: the worker's text at most
        self.worker.send(
            "start", list(prompt_ids), root, capacity, self.gamma, self.sampling, self.seed, self.worker.next_epoch()
        )
        return 1

    def propose(self, root: int) -> Draft:
        if not self.post or self.confirmed + self.gamma > self.capacity:  # pre-verify: a plain target step while
            return Draft.plain(root)  # the worker drafts from the root (or the run's end is near: it drafts no more)
        positions = range(self.confirmed, self.confirmed + self.gamma)
        drafted = [self._draft(position) for position in positions]
        probs = None if self.sampling.greedy else np.stack([np.zeros_like(drafted[0][1]), *(q for _, q in drafted)])
        return Draft(self.tree, [root, *(token for token, _ in drafted)], probs, calls=self.gamma)

    def observe(self, draft: Draft, out: StepOutput, path: Sequence[int], correction: int) -> None:
        accepted = len(path) - 1
        at = self.confirmed + accepted  # the correction's position
        full = accepted == len(draft.tokens) - 1
        # After a full acceptance (or a plain step) the worker's draft at the correction's position is its guess
        # for it; after a rejection it was the rejected draft, which the correction never equals.
        match = full and at < self.capacity and self._draft(at)[0] == correction
        self.confirmed = at + 1
        if match:
            self.worker.send("commit", self.confirmed, correction, self.worker.epoch)
            self.drafts = {p: d for p, d in self.drafts.items() if p >= self.confirmed}
        else:
            self.worker.send("reset", at, correction, self.worker.next_epoch())
            self.drafts = {}
        self.post = match

    def _draft(self, position: int) -> tuple[int, np.ndarray | None]:
        """The worker's draft at `position` of this epoch, waiting for it if it is not in yet."""
        while position not in self.drafts:
            _, epoch, at, token, q = self.worker.receive()
            if epoch == self.worker.epoch:
                if at != len(self.drafts) + min(self.drafts, default=at):
                    raise RuntimeError(
                        f"PEARL's draft worker skipped a position: got {at} after "
                        f"{sorted(self.drafts)[-1:]}; its text differs from the target's"
                    )
                self.drafts[at] = (token, q)
        return self.drafts[position]


def serve(connection, folder: str, engine: str, device: str, core: int | None, load: Callable) -> None:
    """The worker process: load the draft model on one thread (on `core`), then draft on demand."""
    try:
        if core is not None:
            os.sched_setaffinity(0, {core})
        backend = load(Path(folder), engine, device, threads=1, calibrated=False).backend
    except Exception as error:  # reported to the host, which raises it with the folder named
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", backend.name))
    try:
        DraftLoop(backend, connection).run()
    except (EOFError, ConnectionError, KeyboardInterrupt):  # the host went away: nothing to report to
        return
    except Exception as error:
        connection.send(("error", f"{type(error).__name__}: {error}"))


class DraftLoop:
    """The worker's state: `tokens` (prompt + confirmed text + drafts), the first `cached` of them in the draft
    model's cache, `logits` after the last cached one; drafting stops 2 gamma + 1 past the confirmed text."""

    def __init__(self, backend, connection):
        self.backend, self.connection = backend, connection
        self.tokens: list[int] = []
        self.cached = self.confirmed = self.epoch = self.first_epoch = self.gamma = self.seed = self.capacity = 0
        self.sampling = SamplingConfig()
        self.logits: np.ndarray | None = None

    def run(self) -> None:
        while True:
            # while the host verifies gamma drafts after the confirmed text, the next chain and the draft that
            # decides whether it holds: gamma + 1 more (the paper's post-verify)
            if self.logits is not None and len(self.tokens) < min(self.confirmed + 2 * self.gamma + 1, self.capacity):
                while self.connection.poll():
                    self.handle(self.connection.recv())
                self.draft_one()
            else:
                self.handle(self.connection.recv())

    def handle(self, message: tuple) -> None:
        kind, *fields = message
        if kind == "start":
            prompt, root, self.capacity, self.gamma, self.sampling, self.seed, self.epoch = fields
            self.first_epoch = self.epoch
            self.backend.reset(self.capacity)
            self.backend.prefill(prompt, with_streams=False)
            self.tokens, self.cached = [*prompt, root], len(prompt)
            self.confirmed = len(self.tokens)
            self.feed()
        elif kind == "commit":  # the host kept the drafts up to `confirmed`, the last being `token`
            confirmed, token, epoch = fields
            self.check(
                epoch,
                confirmed <= len(self.tokens) and self.tokens[confirmed - 1] == token,
                f"the host confirmed token {token} at {confirmed - 1}, the worker has "
                f"{self.tokens[confirmed - 1] if confirmed <= len(self.tokens) else 'nothing'} there",
            )
            self.confirmed = confirmed
        elif kind == "reset":
            at, token, epoch = fields
            self.check(epoch - 1, at <= len(self.tokens), f"reset at {at} past {len(self.tokens)} tokens")
            self.epoch, self.tokens = epoch, [*self.tokens[:at], token]
            self.confirmed = len(self.tokens)
            if self.cached > at:
                self.cached = at
                self.backend.rollback(at)
            self.feed()
        else:
            raise ValueError(f"unknown message {kind!r}")

    def check(self, epoch: int, ok: bool, what: str) -> None:
        if epoch != self.epoch or not ok:
            raise RuntimeError(f"the host and the worker disagree ({what}; epoch {epoch} against {self.epoch})")

    def feed(self) -> None:
        """Bring the cache up to every token (within the run's capacity), and the logits after the last."""
        while self.cached < min(len(self.tokens), self.capacity):
            out = self.backend.step([self.tokens[self.cached]], None, with_streams=False)
            self.backend.commit([0])
            self.cached += 1
            self.logits = out.main_logits[0]

    def draft_one(self) -> None:
        position = len(self.tokens)
        if self.sampling.greedy:
            token, q = int(np.argmax(self.logits)), None
        else:  # seeded by the run's seed, its resets so far and the position: the same draw whatever the timing
            q = target_probs(self.logits, self.sampling)
            token = draw(q, np.random.default_rng([self.seed, self.epoch - self.first_epoch, position]))
        self.tokens.append(token)
        self.connection.send(("draft", self.epoch, position, token, q))
        self.feed()
