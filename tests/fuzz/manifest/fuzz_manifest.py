"""Fuzz target: the artifact manifest's parser and schema check (runtime/artifact/format.py parse_manifest).

Every input must either give a manifest the schema accepts, from which the runtime's file-free views (trees,
tasks, the acceptance model's replay) build without error, or raise ArtifactError with one line. Anything else
escaping (KeyError, TypeError, RecursionError, ...) is a crash. An input that starts as JSON can ('{', '[',
a digit, ...) is the manifest's bytes, as are the seeds (seeds/: manifests cut down from real ones, the corpus to
start from); any other input picks a seed and mutations of it (a value replaced by one of another type or out of
range, a key dropped or added, a subtree copied, a list cut), which reach past the JSON parser into the schema.

    .venv/bin/python tests/fuzz/manifest/fuzz_manifest.py -max_total_time=600 -rss_limit_mb=4096 \\
        /tmp/manifest-corpus tests/fuzz/manifest/seeds

tests/test_artifact_contract.py runs the same check on a few hundred inputs from hypothesis.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

FUZZING = __name__ == "__main__"
if FUZZING:  # coverage of streamfuse's modules (the parser, the schema, the views), which libFuzzer steers by
    import atheris

with atheris.instrument_imports(include=["streamfuse"]) if FUZZING else contextlib.nullcontext():
    from streamfuse.runtime.artifact.format import Artifact, ArtifactError, parse_manifest

SEEDS = Path(__file__).resolve().parent / "seeds"
WHERE = Path("/artifact/manifest.json")  # named in messages only: nothing is read from it
ODD = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    10**30,
    -(10**30),
    0.5,
    -1e308,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "../outside",
    "/etc/passwd",
    "a/../../b",
    "tokenizer/../..",
    "C:\\x",
    "\ud800",
    "\x00",
    "é" * 3000,
    [],
    {},
    [[]],
    [0],
    [[0]],
    [[[0], 1]],
    {"path": "x"},
    {"paths": [[0]], "lookup": []},
    [[[[[[[[[[[[0]]]]]]]]]]]],
)


RAW = b'{["-0123456789tfn \t\r\n'  # first bytes of an input taken as the manifest itself


class Choices:
    """Decisions read from the fuzz input's bytes (0 once they run out), so one input is one run."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def byte(self) -> int:
        self.at += 1
        return self.data[self.at - 1] if self.at <= len(self.data) else 0

    def below(self, count: int) -> int:
        return (self.byte() << 8 | self.byte()) % count if count > 0 else 0

    def rest(self) -> bytes:
        return self.data[self.at :]


def seeds() -> list[dict]:
    return [json.loads(file.read_text()) for file in sorted(SEEDS.glob("*.json"))]


def _containers(value, found: list) -> list:
    """Every object and list inside `value` (itself first)."""
    if isinstance(value, (dict, list)):
        found.append(value)
        for item in value.values() if isinstance(value, dict) else value:
            _containers(item, found)
    return found


def mutate(manifest: dict, choices: Choices) -> None:
    for _ in range(1 + choices.below(4)):
        containers = _containers(manifest, [])
        target = containers[choices.below(len(containers))]
        keys = list(target) if isinstance(target, dict) else list(range(len(target)))
        operation = choices.below(5)
        if not keys or operation == 0:  # a key or item added
            value = copy.deepcopy(ODD[choices.below(len(ODD))])
            if isinstance(target, dict):
                target[choices.rest()[:8].decode("latin-1") or "extra"] = value
            else:
                target.append(value)
            continue
        key = keys[choices.below(len(keys))]
        if operation == 1:
            del target[key]
        elif operation == 2:
            target[key] = copy.deepcopy(ODD[choices.below(len(ODD))])
        elif operation == 3:  # a subtree copied over another
            target[key] = copy.deepcopy(containers[choices.below(len(containers))])
        elif isinstance(target[key], list):
            del target[key][choices.below(len(target[key]) + 1) :]


def manifest_bytes(data: bytes, bases: list[dict]) -> bytes:
    if not data or data[0] in RAW or not bases:
        return data
    choices = Choices(data[1:])
    manifest = copy.deepcopy(bases[choices.below(len(bases))])
    try:
        mutate(manifest, choices)
        return json.dumps(manifest).encode("utf-8", "surrogatepass")
    except (RecursionError, ValueError):  # a subtree copied into itself: nothing to serialize
        return b"{}"


def check(data: bytes) -> None:
    """The property: accepted and usable, or one ArtifactError line."""
    try:
        manifest = parse_manifest(data, WHERE)
    except ArtifactError as error:
        message = str(error)
        if not message or "\n" in message or "\r" in message:
            raise AssertionError(f"not a one-line error: {message!r}") from None
        return
    artifact = Artifact.view(WHERE.parent, manifest, None)
    for task in artifact.tasks:
        view = Artifact.view(WHERE.parent, manifest, task)
        trees, acceptance = view.trees, view.acceptance
        if acceptance is not None:
            acceptance.expected_tokens(trees[0])
        for backend in view.manifest["calibration"]["backends"]:
            with contextlib.suppress(ArtifactError):  # checked when its backend loads: one line too
                view.calibration(backend)


BASES = seeds()


def test_one(data: bytes) -> None:
    check(manifest_bytes(data, BASES))


def main() -> None:
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
