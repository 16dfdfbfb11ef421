"""streamfuse pearl-replay: PEARL and two-model SD replayed on other devices' call latencies (simulated).

PEARL's gain comes from a second compute unit: the draft model drafts while the target verifies. Greedy
decoding makes both methods a function of one measured sequence: at each position of the target's own answer,
whether the draft model's argmax (fed the same text) is the target's token. This tool measures that sequence on
the artifact's test inputs (--backend: the target's engine, the draft on it too), then replays sd's loop and
methods/pearl/drafter.py's (post-verify, pre-verify, the worker's cap of 2 gamma + 1 drafts, its reset after a
miss) against per-call latencies: a target call of 1 and of gamma + 1 rows, a draft call. Each --device is
"name:target_1_ms,target_verify_ms,draft_ms"; the figures are SIMULATED from the latencies given, which the
output repeats; this machine's own latencies (measured while the matches are, --threads per model) come first,
so the replay can be checked against a real PEARL run here. Prompt processing is left out (tokens/s after the
first token).

    OMP_WAIT_POLICY=PASSIVE streamfuse pearl-replay --artifact artifacts/dialogsum --task dialogsum \
        --limit 20 --gamma 4 --device "this CPU, 1 thread each:48,55,2.6" --device "NPU target, CPU draft:6,7,2.6"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from streamfuse.methods import sd
from streamfuse.runtime.backends.threads import threads_type
from streamfuse.runtime.request.emitter import StopRules
from streamfuse.runtime.request.frontend import BASELINE_METHOD
from streamfuse.runtime.request.inputs import prompt_ids
from streamfuse.runtime.request.loader import load
from streamfuse.runtime.request.settings import DecodeSettings
from streamfuse.runtime.speculation.tree import TreeSpec
from streamfuse.tools.bench_data import read_inputs, task_file
from streamfuse.tools.step_timing import step_seconds


@dataclass(frozen=True)
class Latencies:
    name: str
    target_ms: float  # one target call of 1 row (plain decoding, PEARL's pre-verify)
    verify_ms: float  # one target call of gamma + 1 rows (a chain)
    draft_ms: float  # one draft-model call

    @classmethod
    def parse(cls, text: str) -> Latencies:
        name, _, numbers = text.rpartition(":")
        try:
            target, verify, draft = (float(n) for n in numbers.split(","))
        except ValueError:
            raise ValueError(f"--device takes NAME:TARGET_MS,VERIFY_MS,DRAFT_MS, got {text!r}") from None
        if not name or min(target, verify, draft) <= 0:
            raise ValueError(f"--device takes a name and three positive milliseconds, got {text!r}")
        return cls(name, target, verify, draft)


def sd_seconds(matches: list[bool], gamma: int, lat: Latencies) -> float:
    """Two-model SD on one device (draft and target in turn): each step drafts gamma (gamma + 1 after a chain
    accepted whole: its last draft and the bonus token are fed first) and verifies them."""
    ms, position, pending = 0.0, 1, 1  # position: the first output token after the root
    while position < len(matches):
        accepted = leading(matches, position, gamma)
        ms += (pending + gamma - 1) * lat.draft_ms + lat.verify_ms
        pending = 2 if accepted == gamma else 1
        position += accepted + 1
    return ms / 1000


def pearl_seconds(matches: list[bool], gamma: int, lat: Latencies) -> float:
    """methods/pearl/drafter.py's loop, the worker on its own unit: it drafts one token per draft call from
    `start`, up to 2 gamma + 1 past the confirmed text, and restarts (after its current call and a call that feeds
    the correction) on a reset."""
    worker = Worker(lat.draft_ms, gamma)
    host, position, post = 0.0, 1, False  # position: the output token the next step decides first
    worker.reset(0.0, position)
    while position < len(matches):
        if post:
            host = max(host, worker.ready(position + gamma - 1)) + lat.verify_ms
            accepted = leading(matches, position, gamma)
            at = position + accepted
            post = accepted == gamma and at < len(matches) and matches[at]
            if post:
                host = max(host, worker.ready(at))
        else:  # the host compares the worker's first draft with the plain step's token
            host += lat.target_ms
            at = position
            post = at < len(matches) and matches[at]
            if at < len(matches):
                host = max(host, worker.ready(at))
        position = at + 1
        if post:
            worker.commit(host, position)
        else:
            worker.reset(host, position)
    return host / 1000


class Worker:
    """When each draft is sent: one call per draft, from `free`, positions up to confirmed + 2 gamma."""

    def __init__(self, draft_ms: float, gamma: int):
        self.draft_ms, self.gamma = draft_ms, gamma
        self.sent: dict[int, float] = {}
        self.next = self.confirmed = 0
        self.free = 0.0

    def reset(self, now: float, position: int) -> None:
        """It finishes the call it is in (it drafts on up to its cap unasked), then feeds the correction: the
        call whose logits give the first new draft."""
        busy_until = max(now, self.free)
        room = self.confirmed + 2 * self.gamma + 1 - self.next  # drafts it makes unasked before its cap
        if now > self.free and room > 0:
            busy_until = max(now, self.free + min(room, math.ceil((now - self.free) / self.draft_ms)) * self.draft_ms)
        self.free, self.sent, self.next, self.confirmed = busy_until, {}, position, position

    def commit(self, now: float, confirmed: int) -> None:
        if self.next > self.confirmed + 2 * self.gamma:  # it was waiting at its cap
            self.free = max(self.free, now)
        self.confirmed = confirmed

    def ready(self, position: int) -> float:
        while self.next <= position:
            self.free += self.draft_ms
            self.sent[self.next] = self.free
            self.next += 1
        return self.sent[position]


def leading(matches: list[bool], start: int, gamma: int) -> int:
    """Drafts accepted from `start`: the matches before the first miss, at most gamma, within the answer."""
    count = 0
    while count < gamma and start + count < len(matches) and matches[start + count]:
        count += 1
    return count


def measured_matches(args) -> tuple[list[list[bool]], Latencies]:
    """Per input: at each output position, whether the draft model's argmax (fed the target's own text) is the
    target's greedy token (position 0, the prefill's token, is the root: never drafted); and this machine's
    call latencies at the end of each answer (medians): a target call of 1 and gamma + 1 rows, a draft call."""
    target = load(args.artifact, args.backend, threads=args.threads)
    draft = load(target.artifact.drafter_path(sd.NAME), args.backend, threads=args.threads, calibrated=False).backend
    inputs = read_inputs(args.input_file or task_file(args.task, args.split), target.prompt, args.limit)
    rules = StopRules(args.max_new_tokens, target.stop_token_ids)
    chain = TreeSpec.chain(args.gamma)
    from streamfuse.runtime.request.decode import generate

    found, times = [], {"target": [], "verify": [], "draft": []}
    for item in tqdm(inputs, desc="greedy + teacher-forced draft", unit="input"):
        prompt = prompt_ids(target, item.text, as_task=True)
        answer = generate(target.backend, prompt, DecodeSettings(BASELINE_METHOD, rules)).token_ids
        draft.reset(len(prompt) + len(answer) + 1)
        logits = draft.prefill(prompt, with_streams=False).main_logits[0]
        row = []
        for token in answer:
            row.append(int(np.argmax(logits)) == token)
            logits = draft.step([token], None, with_streams=False).main_logits[0]
            draft.commit([0])
        found.append(row)
        times["target"].append(step_seconds(target.backend, answer[-1:], None))
        times["verify"].append(step_seconds(target.backend, answer[-1:] * (args.gamma + 1), chain))
        times["draft"].append(step_seconds(draft, answer[-1:], None))
    here = Latencies(
        f"this machine ({args.backend}, {args.threads} thread(s) per model), measured",
        *(round(1000 * float(np.median(times[k])), 2) for k in ("target", "verify", "draft")),
    )
    return found, here


def replay(matches: list[list[bool]], gamma: int, devices: list[Latencies]) -> list[dict]:
    tokens = sum(len(row) - 1 for row in matches)
    rows = []
    for lat in devices:
        ar = sum((len(row) - 1) * lat.target_ms / 1000 for row in matches)
        sd = sum(sd_seconds(row, gamma, lat) for row in matches)
        pearl = sum(pearl_seconds(row, gamma, lat) for row in matches)
        rows.append(
            {
                "device": lat.name,
                "latencies_ms": asdict(lat),
                "gamma": gamma,
                "tokens": tokens,
                "ar_tokens_per_s": tokens / ar,
                "sd_tokens_per_s": tokens / sd,
                "pearl_tokens_per_s": tokens / pearl,
                "sd_vs_ar": ar / sd,
                "pearl_vs_ar": ar / pearl,
                "pearl_vs_sd": sd / pearl,
            }
        )
    return rows


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="an artifact with sd's draft model")
    parser.add_argument("--task", default="dialogsum")
    parser.add_argument("--split", default="test")
    parser.add_argument("--input-file", type=Path, default=None, help="inputs instead of the task split's file")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--backend", default="onnxruntime", help="the engine that measures the matches")
    parser.add_argument("--threads", type=threads_type, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument(
        "--device",
        action="append",
        default=[],
        help="NAME:TARGET_MS,VERIFY_MS,DRAFT_MS, repeatable (this machine's measured calls come first)",
    )
    parser.add_argument("--matches", type=Path, default=None, help="read/write the measured matches here")
    parser.add_argument("--out", type=Path, default=None, help="write the simulated table as JSON here")
    args = parser.parse_args(argv)
    try:
        args.devices = [Latencies.parse(text) for text in args.device]
    except ValueError as error:
        parser.error(str(error))
    if args.gamma < 1:
        parser.error(f"--gamma must be >= 1, got {args.gamma}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.matches is not None and args.matches.is_file():
        stored = json.loads(args.matches.read_text())
        matches, here = stored["matches"], stored.get("here")
    else:
        matches, measured = measured_matches(args)
        here = asdict(measured)
        if args.matches is not None:
            args.matches.write_text(
                json.dumps({"backend": args.backend, "limit": args.limit, "here": here, "matches": matches})
            )
    rows = replay(matches, args.gamma, ([Latencies(**here)] if here else []) + args.devices)
    accepted = sum(sum(row[1:]) for row in matches) / max(1, sum(len(row) - 1 for row in matches))
    print(f"SIMULATED from the latencies given; draft argmax == target token at {100 * accepted:.1f}% of positions")
    for row in rows:
        lat = row["latencies_ms"]
        print(
            f"{row['device']}: target {lat['target_ms']} ms, verify {lat['verify_ms']} ms, draft {lat['draft_ms']} ms "
            f"-> AR {row['ar_tokens_per_s']:.1f} tok/s, SD {row['sd_vs_ar']:.2f}x, PEARL {row['pearl_vs_ar']:.2f}x "
            f"({row['pearl_vs_sd']:.2f}x SD)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"simulated": True, "match_rate": accepted, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
