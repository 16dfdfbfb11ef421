"""Hostile inputs through the CLI, the Python API and tampered copies of an artifact.

Every case must end in a one-line error (or, where marked, the right result): never a crash (a signal, exit 134 or
139), a traceback, a hang, or a file left half-written in the artifact. Each case runs in its own process, on its own
copy of the artifact where it tampers with one.

    streamfuse probe --artifact artifacts/dialogsum --backend onnxruntime
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CRASHES = (134, 139)  # SIGABRT, SIGSEGV as a shell reports them (a negative code: the signal itself)
TIMEOUT_S = 300.0
Tamper = Callable[[Path], None]

# The Python API's side of a case: load, then generate; a ValueError is the API's one-line error, printed on stdout
# after "error:" (an engine's own logging may write to stderr in a library's process; the CLI filters it).
API = """
import sys
from streamfuse.runtime.request.api import Model
from streamfuse.runtime.request.frontend import DecodeRequest, load_model
from streamfuse.runtime.request.inputs import prompt_ids
try:
    loaded = load_model({artifact!r}, backend={backend!r}, threads=2)
    ids = prompt_ids(loaded, {prompt!r}, as_task=False)
    result = Model(loaded).run(ids, DecodeRequest(max_new_tokens=4, fallback=False))
except ValueError as error:
    print("error:", error)
    sys.exit(1)
print(len(result.token_ids))
"""

# The torch op given an `out` too small for its result (without its validator it overflows the heap).
SMALL_OUT = """
import sys, torch
from streamfuse.runtime.ops import tree_attention
tree_attention.torch_op()
q = torch.zeros(1, 2, 3, 8); kc = torch.zeros(1, 1, 16, 8); kx = torch.zeros(1, 1, 3, 8)
try:
    torch.ops.streamfuse.tree_attention.out(q, kc, kc.clone(), 0, torch.tensor([4]), kx, kx.clone(),
                                            torch.ones(3, 3), 0.3, 0, out=torch.empty(1))
except (RuntimeError, ValueError) as error:
    print("error:", error)
    sys.exit(1)
"""


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...] = ()  # the CLI's arguments after --artifact/--backend; empty: `code` runs instead
    code: str = ""  # Python source run as `python -c` (formatted with artifact, backend, prompt)
    tamper: Tamper | None = None  # edits the case's copy of the artifact
    ok: bool = False  # the right result is expected rather than an error
    names: str = ""  # a word the error's line must contain (case-insensitive): it names the right problem
    prompt: str = "Hello."


@dataclass(frozen=True)
class Outcome:
    case: str
    passed: bool
    code: int
    message: str  # the one line, or what went wrong


def edit_json(relative: str, change: Callable[[dict], None]) -> Tamper:
    def tamper(folder: Path) -> None:
        path = folder / relative
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return tamper


def append_bytes(relative: str, extra: bytes) -> Tamper:
    def tamper(folder: Path) -> None:
        with open(folder / relative, "ab") as handle:
            handle.write(extra)

    return tamper


def replace_with_link(relative: str, target: str) -> Tamper:
    def tamper(folder: Path) -> None:
        (folder / relative).unlink()
        os.symlink(target, folder / relative)

    return tamper


def grow_engine_files(folder: Path) -> None:
    """One byte more in every engine's weights (a copy cut or extended in transit)."""
    for relative in ("model.pte", "onnx/weights.bin"):
        if (folder / relative).exists():
            append_bytes(relative, b"\0")(folder)


def write_text(relative: str, text: str) -> Tamper:
    return lambda folder: (folder / relative).write_text(text)


def model_path(new_path: str) -> Callable[[dict], None]:
    """Points every engine file at `new_path` (the manifest's files: engine -> role -> path, bytes, sha256)."""

    def change(manifest: dict) -> None:
        for roles in manifest["files"].values():
            for entry in roles.values():
                entry["path"] = new_path

    return change


def cases(invalid_utf8: Path) -> list[Case]:
    """The hostile inputs, and one well-formed request of each kind that must succeed; `invalid_utf8` is a JSON-lines
    file with bytes that are not UTF-8."""
    return [
        Case("a well-formed request (CLI)", ("--prompt", "Hello.", "--max-new-tokens", "4"), ok=True),
        Case("a well-formed request (API)", code=API, ok=True),
        Case("a huge tree spec", ("--prompt", "Hi", "--tree", "gamma=8,k=10"), names="nodes"),
        Case("a tree spec that is a list of ints", ("--prompt", "Hi", "--tree", "[1]"), names="path"),
        Case("a tree spec that is an object", ("--prompt", "Hi", "--tree", '{"x": 1}'), names="paths"),
        Case("an empty tree spec", ("--prompt", "Hi", "--tree", "[]"), names="at least one"),
        Case("a tree with a missing parent", ("--prompt", "Hi", "--tree", "[[0, 0]]"), names="parent"),
        Case("a negative tree size", ("--prompt", "Hi", "--tree", "gamma=-1,k=2"), names="gamma"),
        Case("zero threads", ("--prompt", "Hi", "--threads", "0"), names="threads"),
        Case("a million threads", ("--prompt", "Hi", "--threads", "1000000"), names="threads"),
        Case("a lone surrogate in the prompt (CLI)", ("--prompt", "Hi \udcff there"), names="surrogate"),
        Case("a lone surrogate in the prompt (API)", code=API, prompt="Hi \ud800 there", names="surrogate"),
        Case("invalid UTF-8 in an input file", ("--input-file", str(invalid_utf8)), names="UTF-8"),
        Case(
            "the manifest is not JSON",
            ("--prompt", "Hi"),
            tamper=write_text("manifest.json", "{not json"),
            names="JSON",
        ),
        Case(
            "the manifest lacks a key",
            ("--prompt", "Hi"),
            tamper=edit_json("manifest.json", lambda m: m.pop("model")),
            names="model",
        ),
        Case(
            "a manifest value of the wrong type",
            ("--prompt", "Hi"),
            tamper=edit_json("manifest.json", lambda m: m["model"].update(num_layers="thirty")),
            names="num_layers",
        ),
        Case(
            "a manifest path that is absolute",
            ("--prompt", "Hi"),
            tamper=edit_json("manifest.json", model_path("/etc/passwd")),
            names="path",
        ),
        Case(
            "a manifest path that climbs out",
            ("--prompt", "Hi"),
            tamper=edit_json("manifest.json", model_path("../../../etc/passwd")),
            names="path",
        ),
        Case(
            "a tokenizer folder outside",
            ("--prompt", "Hi"),
            tamper=edit_json("manifest.json", lambda m: m["tokenizer"].update(path="/usr/share")),
            names="tokenizer",
        ),
        Case(
            "a tokenizer file linked outside",
            ("--prompt", "Hi"),
            tamper=replace_with_link("tokenizer/tokenizer.json", "/etc/hostname"),
            names="tokenizer.json",
        ),
        Case(
            "an edited tokenizer_config.json",
            ("--prompt", "Hi"),
            tamper=edit_json("tokenizer/tokenizer_config.json", lambda c: c.update(eos_token="<|endoftext|>")),
            names="tokenizer_config.json",
        ),
        Case(
            "an edited chat template",
            ("--prompt", "Hi"),
            tamper=append_bytes("tokenizer/chat_template.jinja", b"{{ 'x' }}"),
            names="chat_template.jinja",
        ),
        Case(
            "a manifest without trees (API)",
            code=API,
            tamper=edit_json("manifest.json", lambda m: m.pop("trees")),
            names="trees",
        ),
        Case("an engine file one byte longer", ("--prompt", "Hi"), tamper=grow_engine_files, names="bytes"),
        Case("the torch op with a one-element out", code=SMALL_OUT, names="out"),
    ]


def one_line(stderr: str) -> str | None:
    """The error's one line, or None where stderr is not exactly one line (a traceback, a stack of warnings)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 and "Traceback" not in lines[0] else None


def api_error(stdout: str) -> str:
    """The API's error as the snippet printed it (empty where it printed none: an exception escaped)."""
    lines = [line for line in stdout.splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else ""


def snapshot(folder: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime) for p in folder.rglob("*")}


def run_case(case: Case, artifact: Path, backend: str, scratch: Path) -> Outcome:
    folder = artifact
    if case.tamper is not None:
        folder = scratch / "copy"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(artifact, folder, symlinks=True)
        case.tamper(folder)
    before = snapshot(folder)
    if case.argv:
        command = [
            sys.executable,
            "-m",
            "streamfuse.runtime.commands.generate",
            "--artifact",
            str(folder),
            "--backend",
            backend,
            *case.argv,
        ]
    else:
        command = [sys.executable, "-c", case.code.format(artifact=str(folder), backend=backend, prompt=case.prompt)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Outcome(case.name, False, -1, f"no answer in {TIMEOUT_S:.0f} s")
    left = sorted(set(snapshot(folder)) - set(before))
    message = one_line(done.stderr if case.argv else api_error(done.stdout))
    if done.returncode < 0 or done.returncode in CRASHES:
        return Outcome(case.name, False, done.returncode, f"crashed: {done.stderr.strip()[-300:]}")
    if left:
        return Outcome(case.name, False, done.returncode, f"left files behind: {left}")
    if case.ok:
        passed = done.returncode == 0
        return Outcome(case.name, passed, done.returncode, "ok" if passed else done.stderr.strip()[-300:])
    if done.returncode == 0:
        return Outcome(case.name, False, 0, "accepted a bad input")
    if message is None:
        return Outcome(case.name, False, done.returncode, f"not one line: {done.stderr.strip()[-600:]}")
    if case.names.lower() not in message.lower():
        return Outcome(case.name, False, done.returncode, f"names another problem (wanted {case.names!r}): {message}")
    return Outcome(case.name, True, done.returncode, message)


def probe(artifact: Path, backend: str, only: str = "", extra: tuple[Case, ...] = ()) -> list[Outcome]:
    """The cases whose name contains `only` (all by default), then `extra`, each in its own process."""
    with tempfile.TemporaryDirectory(prefix="streamfuse-probe-") as scratch:
        invalid = Path(scratch) / "invalid-utf8.jsonl"
        invalid.write_bytes(b'{"prompt": "caf\xe9 \xff"}\n')
        chosen = [c for c in cases(invalid) if only in c.name] + list(extra)
        return [run_case(case, artifact, backend, Path(scratch)) for case in chosen]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True, help="an exported artifact (left untouched)")
    parser.add_argument("--backend", default="onnxruntime", help="the engine the CLI and API cases load")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args(argv)
    outcomes = probe(args.artifact.resolve(), args.backend, args.only)
    for outcome in outcomes:
        print(f"{'PASS' if outcome.passed else 'FAIL'}  {outcome.case:45s}  exit {outcome.code:4d}  {outcome.message}")
    failed = sum(not o.passed for o in outcomes)
    print(f"{len(outcomes) - failed}/{len(outcomes)} cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
