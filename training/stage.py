"""A trained stage of the build (a checkpoint, a drafter's heads): a folder that its inputs determine.

Each stage names what determines its output (config sections, the keys of the stages it reads) and
how to make it; `Stage.output` is the one place that decides whether to make it again. The key is a
content hash of the inputs, recorded in the output's manifest (info.training_key): a rerun with the
same inputs finds it there and reuses the folder. A fresh output is written to a staging folder
beside its place and renamed into it, so an interrupted stage leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path


def content_key(inputs: dict, kind: str) -> str:
    """16 hex digits of sha256 over the inputs' sorted JSON, then what made it: "3f2a...-sd".
    Changing this changes every stage's key, and every cached checkpoint and head is made again."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16] + f"-{kind}"


def recipe(section, *runtime_choices: str) -> dict:
    """A method's config section as a stage input: without `enabled` and the fields the runtime chooses
    (a draft count, a threshold), which change nothing that trains."""
    return {k: v for k, v in asdict(section).items() if k not in ("enabled", *runtime_choices)}


@dataclass(frozen=True)
class OutputFormat:
    """How a stage's folder records what it holds: the manifest file (written last, or with the folder's
    rename: its presence means complete) and the reader that checks its format."""

    manifest: str
    read: Callable[[Path], dict]

    def info(self, directory: Path) -> dict:
        """The recorded info; {} when there is none yet, or one of another format (made again)."""
        if not (directory / self.manifest).is_file():
            return {}
        try:
            return self.read(directory)["info"]
        except ValueError:
            return {}


@dataclass(frozen=True)
class Stage:
    """label: the log's tag ("[sd] ..."); directory: the output's place; kind: the key's suffix;
    inputs: what determines the output; run(folder, stage): write the output into `folder` (empty, beside
    `directory`), its manifest's info recording stage.key, and return the log's line about it.
    made_from: {info field: weights digest} of upstream checkpoints that the key leaves out (their key
    is in it), which a reused output must have been made from; one that records none is
    taken at its key."""

    label: str
    directory: Path
    kind: str
    inputs: dict
    format: OutputFormat
    run: Callable[[Path, Stage], str]
    made_from: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return content_key(self.inputs, self.kind)

    @property
    def scratch(self) -> Path:
        """Where run may keep work between tries (a resumable training's snapshots); removed once the
        output is in place."""
        return self.directory.with_name(f"{self.directory.name}-{self.key}.snapshot")

    def reusable(self) -> bool:
        info = self.format.info(self.directory)
        if info.get("training_key") != self.key:
            return False
        return all(info.get(name, {}).get("weights", digest) == digest for name, digest in self.made_from.items())

    def output(self) -> Path:
        """The stage's folder: the existing one when it holds this key's output, else made now."""
        if self.reusable():
            print(f"[{self.label}] reusing {self.directory} (same settings)", flush=True)
            return self.directory
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.directory.name}.partial-", dir=self.directory.parent))
        try:
            said = self.run(staging, self)
            move_into_place(staging, self.directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        print(f"[{self.label}] {said} -> {self.directory}", flush=True)
        return self.directory


def move_into_place(staging: Path, directory: Path) -> None:
    """Rename `staging` to `directory`; an older output there is set aside first and removed after, so
    the place never holds a half-written or half-removed one."""
    old = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    staging.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
