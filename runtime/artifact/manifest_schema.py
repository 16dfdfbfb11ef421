"""The manifest's declared schema: every field the runtime reads, with its type and range.

runtime/artifact/format.py checks a manifest against MANIFEST before any of it is used, so a missing key, a wrong type
or an out-of-range value is one SchemaError naming the key (e.g. `files.onnxruntime.model.bytes`), never a
KeyError deep in a backend. Records are closed unless marked open: a field this table does not declare is a
manifest from another streamfuse. Paths are checked here lexically (relative, no `..`); runtime/artifact/format.py
resolves them against the artifact folder.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath, PureWindowsPath

from streamfuse.runtime.artifact.contract import CACHE_OWNERS
from streamfuse.runtime.methods import registry

NAME = r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}"  # a task, backend, method or file key: also a path part, so no '/'
SHA256 = r"[0-9a-f]{64}"
MAX_BYTES = 1 << 44  # a file's size: larger than any model this runtime runs
MAX_ITEMS = 1 << 16  # a list or map's length


class SchemaError(ValueError):
    """`key` (a dotted path into the manifest) is not what the schema declares."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key or 'the manifest'} {problem}")
        self.key, self.problem = key, problem


def show(value: object) -> str:
    """A value for a one-line message: its repr (newlines escaped), cut short."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def kind(value: object) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


def child(key: str, name: object) -> str:
    """The dotted path of `name` under `key` (a list index or an odd name in brackets)."""
    if isinstance(name, int):
        return f"{key}[{name}]"
    if not re.fullmatch(NAME, name):
        return f"{key}[{show(name)}]"
    return f"{key}.{name}" if key else name


class Spec:
    def check(self, value: object, key: str) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Spec):
    low: int = 0
    high: int = 1 << 31

    def check(self, value, key):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SchemaError(key, f"must be an integer, got {kind(value)}")
        if not self.low <= value <= self.high:
            raise SchemaError(key, f"must be in [{self.low}, {self.high}], got {show(value)}")


@dataclass(frozen=True)
class Num(Spec):
    low: float = 0.0
    high: float = 1e12

    def check(self, value, key):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SchemaError(key, f"must be a number, got {kind(value)}")
        if not (math.isfinite(value) and self.low <= value <= self.high):
            raise SchemaError(key, f"must be a finite number in [{self.low:g}, {self.high:g}], got {show(value)}")


@dataclass(frozen=True)
class Str(Spec):
    pattern: str | None = None
    choices: tuple[str, ...] = ()
    max_len: int = 1 << 16

    def check(self, value, key):
        if not isinstance(value, str):
            raise SchemaError(key, f"must be a string, got {kind(value)}")
        if len(value) > self.max_len:
            raise SchemaError(key, f"must be at most {self.max_len} characters, got {len(value)}")
        if self.choices and value not in self.choices:
            raise SchemaError(key, f"must be one of {', '.join(self.choices)}, got {show(value)}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise SchemaError(key, f"must match {self.pattern}, got {show(value)}")


class Bool(Spec):
    def check(self, value, key):
        if not isinstance(value, bool):
            raise SchemaError(key, f"must be true or false, got {kind(value)}")


class RelPath(Spec):
    """A path inside the artifact, '/'-separated: relative, no '..' or empty parts, no backslash or drive."""

    def check(self, value, key):
        Str(max_len=1024).check(value, key)
        parts = value.split("/")
        if (
            not value
            or PurePosixPath(value).is_absolute()
            or PureWindowsPath(value).drive
            or "\\" in value
            or "\0" in value
            or any(part in ("", ".", "..") for part in parts)
        ):
            raise SchemaError(
                key, f"must be a relative path inside the artifact (no '/' first, no '..'), got {show(value)}"
            )


@dataclass(frozen=True)
class Maybe(Spec):
    spec: Spec

    def check(self, value, key):
        if value is not None:
            self.spec.check(value, key)


@dataclass(frozen=True)
class ListOf(Spec):
    item: Spec
    low: int = 0
    high: int = MAX_ITEMS

    def check(self, value, key):
        if not isinstance(value, list):
            raise SchemaError(key, f"must be a list, got {kind(value)}")
        if not self.low <= len(value) <= self.high:
            raise SchemaError(key, f"must have {self.low} to {self.high} items, got {len(value)}")
        for index, item in enumerate(value):
            self.item.check(item, child(key, index))


@dataclass(frozen=True)
class Tuple(Spec):
    """A list of fixed length, an item of its own type at each place."""

    items: tuple[Spec, ...]

    def check(self, value, key):
        if not isinstance(value, list) or len(value) != len(self.items):
            raise SchemaError(
                key,
                f"must be a list of {len(self.items)} items, got {kind(value)}"
                f"{f' of {len(value)}' if isinstance(value, list) else ''}",
            )
        for index, (spec, item) in enumerate(zip(self.items, value)):
            spec.check(item, child(key, index))


class Dict(Spec):
    """Any JSON object (records kept for people and reports, read with .get)."""

    def check(self, value, key):
        if not isinstance(value, dict):
            raise SchemaError(key, f"must be an object, got {kind(value)}")


@dataclass(frozen=True)
class MapOf(Spec):
    value: Spec
    keys: str = NAME
    high: int = 256

    def check(self, value, key):
        Dict().check(value, key)
        if len(value) > self.high:
            raise SchemaError(key, f"must have at most {self.high} entries, got {len(value)}")
        for name, item in value.items():
            if not re.fullmatch(self.keys, name):
                raise SchemaError(child(key, name), f"is not a valid name (it must match {self.keys})")
            self.value.check(item, child(key, name))


@dataclass(frozen=True)
class Record(Spec):
    """An object with these fields; `optional` ones may be left out; `open`: undeclared fields are allowed."""

    fields: Mapping[str, Spec]
    optional: Mapping[str, Spec] = field(default_factory=dict)
    open: bool = False

    def check(self, value, key):
        Dict().check(value, key)
        for name, spec in self.fields.items():
            if name not in value:
                raise SchemaError(child(key, name), "is missing")
            spec.check(value[name], child(key, name))
        for name, spec in self.optional.items():
            if name in value:
                spec.check(value[name], child(key, name))
        unknown = set(value) - set(self.fields) - set(self.optional)
        if unknown and not self.open:
            raise SchemaError(child(key, sorted(unknown)[0]), "is not a field of this schema")


SIZE, DIGEST = Int(0, MAX_BYTES), Str(SHA256)
FILE_DIGEST = Record({"bytes": SIZE, "sha256": DIGEST})  # file_digest's record
FILE = Record({"path": RelPath(), **FILE_DIGEST.fields})  # ... and where the file is
VOCAB_FILE = Record({**FILE.fields, "size": Int(1, 1 << 24), "coverage": Num(0, 1)})  # export/draft_vocab.py
COUNT, DIM, RANK = Int(1, 1 << 24), Int(1, 1 << 16), Int(-1, 1 << 16)  # rank -1: no draft there
KEY = Str(max_len=256)
TREE = Record(
    {"paths": ListOf(ListOf(Int(0, 1 << 16), 1, 64), 0, 4096), "lookup": ListOf(Int(0, 1 << 16), 0, 64)},
    {"num_nodes": Int(1, 4097), "depth": Int(0, 64), "hash": Str(r"[0-9a-f]{16}")},
)
ACCEPTANCE = Record(
    {
        "max_rank": DIM,
        "depth": Int(1, 64),
        "positions": Int(0, 1 << 40),
        "answers": ListOf(ListOf(Tuple((ListOf(RANK, 0, 64), RANK))), 1),
    }
)
PROMPT = Record({"instruction_template": Str(), "source_template": Str(), "max_source_tokens": COUNT})
# the checkpoint the torch backend loads (its whole folder's digest) and what training recorded of it
ADAPTER = Record(
    {"path": RelPath(), "lora": Dict(), "training_key": Maybe(KEY), "weights_sha256": KEY, **FILE_DIGEST.fields}
)
# A backend's own record is checked when that backend loads it (Artifact.calibration): calibrating again
# replaces one this streamfuse cannot read, so it must not stop the artifact from opening.
CALIBRATION = Record({"acceptance": Maybe(ACCEPTANCE), "backends": MapOf(Dict())})
BACKEND_CALIBRATION = Record(
    {  # runtime/speculation/calibration.py BackendCalibration.to_dict; the plain step's cost divides
        "device": KEY,
        "threads": Int(1, 1 << 12),
        "plain_ms": Num(1e-3, 1e9),
        "prefill_ms_per_token": Num(0, 1e9),
        "prompt_tokens": Num(0, 1e9),
        "trees": ListOf(
            Record(
                {
                    "tree": TREE,
                    "step_ms": Num(1e-3, 1e9),
                    "expected_tokens": Num(0, 1e4),
                    "realised_tokens": Num(0, 1e4),
                    "two_calls": Bool(),
                    "other_ms": Maybe(Num(1e-3, 1e9)),
                },
                open=True,
            ),
            1,
            4096,
        ),
    },
    open=True,
)
# Every drafter's folder (drafters/<method>, digest of the whole folder) and what its method reads of the entry
# (each method declares the fields it needs: Method.entry_needs).
DRAFTER = Record(
    {**FILE.fields},
    {
        "tree": TREE,
        "training_key": Maybe(KEY),
        "threshold": Num(0, 1),
        "draft": Str(NAME),
        "heads": Int(1, 64),
        "layers": Int(1, 4096),
        "graphs": MapOf(RelPath()),
        "embedding": RelPath(),
        "vocab_file": RelPath(),
        "block": DIM,
        "rows": DIM,
        "slots": COUNT,
        "masks": DIM,
        "capacity": COUNT,
        "max_passes": DIM,
        "cache": Tuple((DIM, DIM)),
    },
    open=True,
)


def entry_needs(entry: str) -> tuple[str, ...]:
    """What drafters/<entry> must hold: the fields its method (the registered one of that name) reads of it."""
    return registry.get(entry).entry_needs if entry in registry.names() else ()


class Drafters(Spec):
    def check(self, value, key):
        MapOf(DRAFTER).check(value, key)
        for method, entry in value.items():
            for name in entry_needs(method):
                if name not in entry:
                    raise SchemaError(child(child(key, method), name), f"is missing (method {method} reads it)")


# What each task of an artifact has of its own (runtime/artifact/format.py TASK_FIELDS).
TASK = Record(
    {
        "task": Str(NAME),
        "prompt": Maybe(PROMPT),
        "adapter": ADAPTER,
        "task_files": MapOf(FILE),
        "trees": ListOf(TREE, 1, 64),
        "calibration": CALIBRATION,
        "drafters": Drafters(),
        "parity": MapOf(Maybe(Dict())),
        "build_key": KEY,
        "created": KEY,
        "info": Dict(),
        "profile": Maybe(Dict()),
    }
)
MODEL = Record(
    {
        "base_model": KEY,
        "num_layers": DIM,
        "hidden_size": COUNT,
        "num_kv_heads": DIM,
        "head_dim": DIM,
        "vocab_size": COUNT,
        "max_positions": COUNT,
        "num_parameters": Int(0, 1 << 48),
        "head_vocab": Maybe(VOCAB_FILE),
    }
)
GRAPHS = Record(
    {
        "key": KEY,
        "capacity": COUNT,
        "prefill_chunk": COUNT,
        "buckets": ListOf(Int(2, 1 << 12), 1, 64),
        # [sequences, rows] of each batched step (runtime/artifact/contract.py batch_method): the engine-cache graphs'
        # only
        "batches": ListOf(ListOf(Int(1, 1 << 12), 2, 2), 0, 64),
        "dtype": KEY,
        "stream_schedule": KEY,
        "quantize": MapOf(KEY),
        "formats": MapOf(Dict()),
        "coreml_precision": KEY,
        "greedy_step": Record(
            {
                "schedules": ListOf(Str(choices=("fused", "deferred")), 1, 64),
                "width": COUNT,
                "draft_vocab": Maybe(VOCAB_FILE),
            }
        ),
        "heads": Record({"count": Int(0, 64), "training_key": Maybe(KEY)}),
        "methods": MapOf(Dict()),
    }
)
KV_LAYOUT = Record(
    {
        "axes": ListOf(KEY, 4, 4),
        "shape": ListOf(COUNT, 4, 4),
        "capacity": COUNT,
        "dtype": KEY,
        "owner": MapOf(Str(choices=CACHE_OWNERS)),
    }
)
# Every file of the tokenizer folder by name: each changes how text becomes ids (the chat template, the eos).
TOKENIZER = Record(
    {
        "path": RelPath(),
        "vocab_size": COUNT,
        "eos_token_id": Maybe(Int(0, 1 << 24)),
        "files": MapOf(FILE_DIGEST, high=64),
    }
)
MANIFEST = Record(
    {
        "schema": KEY,
        **TASK.fields,
        "model": MODEL,
        "streams": Record({"num_streams": Int(1, 64)}, open=True),
        "graphs": GRAPHS,
        "kv_layout": KV_LAYOUT,
        "tokenizer": TOKENIZER,
        "tasks": MapOf(TASK),
        "files": MapOf(MapOf(FILE, high=16)),
        "export_seconds": MapOf(Num()),
        "versions": MapOf(KEY),
    }
)
TOKENIZER_NEEDS = ("tokenizer.json", "tokenizer_config.json")  # what runtime/artifact/tokenizer.py reads


def check(manifest: object) -> None:
    """SchemaError unless `manifest` is what MANIFEST declares, its parts consistent with each other."""
    MANIFEST.check(manifest, "")
    graphs, files = manifest["graphs"], manifest["files"]
    schedules, buckets = graphs["greedy_step"]["schedules"], graphs["buckets"]
    if len(schedules) != len(buckets):
        raise SchemaError(
            "graphs.greedy_step.schedules", f"must have one schedule per bucket ({len(buckets)}), got {len(schedules)}"
        )
    for index, (sequences, rows) in enumerate(graphs["batches"]):
        if sequences < 2 or rows not in (1, *buckets):
            problem = f"must be [2 or more sequences, 1 or a bucket's rows], got {[sequences, rows]}"
            raise SchemaError(child("graphs.batches", index), problem)
    if set(manifest["kv_layout"]["owner"]) != set(files):
        raise SchemaError(
            "kv_layout.owner", f"must name the backends of `files` ({', '.join(sorted(files)) or 'none'})"
        )
    if manifest["task"] in manifest["tasks"]:
        raise SchemaError(child("tasks", manifest["task"]), "is the artifact's own task, which the top level holds")
    for name in TOKENIZER_NEEDS:
        if name not in manifest["tokenizer"]["files"]:
            raise SchemaError(child("tokenizer.files", name), "is missing")
