"""Task interface and data location shared by every task.

Data is looked up, in order:

1. the ``data_dir`` argument (the directory holding the files, or its ``<task>``
   subfolder); when given, nothing else is tried, so a typo never silently
   falls back to the network;
2. ``$STREAMFUSE_DATA_DIR/<task>``;
3. the shared copy ``<repo root>/../shared/data/<task>``;
4. the dataset hub via ``datasets.load_dataset`` (imported lazily: it is an
   optional dependency and slow to import).

If all of these fail, :class:`DataError` says what was looked for and where,
and how to supply the files.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "validation", "test")
UNLABELLED = "unlabelled"  # inputs without references: self-distillation's targets are the model's own answers
DATA_DIR_ENV = "STREAMFUSE_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]
# Module global (not inlined) so tests can point it elsewhere.
SHARED_DATA_ROOT = REPO_ROOT.parent / "shared" / "data"


class DataError(ValueError):
    """Task data is missing or malformed; the message says where and how to fix it."""


class HubUnavailable(Exception):
    """The hub fallback cannot be used; turned into a DataError listing local paths."""


@dataclass(frozen=True)
class Example:
    id: str
    source: str  # the model input text (dialogue / meaning representation / question+schema)
    references: tuple[str, ...]  # 1+ reference outputs (test splits can have several)


class Task(ABC):
    name: str  # registry key, e.g. "dialogsum"
    hub_id: str  # e.g. "knkarthick/dialogsum"
    headline_metrics: tuple[str, ...]  # the metrics the paper reports
    hub_revision: str | None = None  # hub branch to load, when main is not loadable
    has_unlabelled: bool = False  # the task's data has an UNLABELLED split (local files only)
    data_help: str  # expected local file names and fields, shown in errors
    # "--set" assignments the cpu presets apply for this task before the user's own (its lengths, and
    # the epochs that keep the presets' step budget): the presets are written for DialogSum.
    cpu_settings: tuple[str, ...] = ()

    # --- what each task provides -------------------------------------------

    @abstractmethod
    def local_files(self, split: str) -> tuple[str, ...]:
        """File names that can hold *split*, in order of preference (any one suffices)."""

    @abstractmethod
    def read_local(self, split: str, path: Path) -> list[Example]:
        """Examples of *split* from a local file found by :meth:`local_files`."""

    @abstractmethod
    def read_hub(self, split: str) -> list[Example]:
        """Examples of *split* from the hub; use :meth:`hub_rows` to fetch."""

    instruction_template: str  # the user message, "{source}" marks where the source goes
    source_template: str  # how a raw input row's fields make the source, e.g. "{dialogue}"

    @abstractmethod
    def score(self, predictions: Sequence[str], references: Sequence[tuple[str, ...]]) -> dict[str, float]:
        """Corpus-level metrics in percent (0-100)."""

    # --- shared loading logic ----------------------------------------------

    def load(self, split: str, data_dir: Path | None = None, limit: int | None = None) -> list[Example]:
        """Examples of *split* in a deterministic order; ``limit`` keeps the first N."""
        if split not in SPLITS and not (split == UNLABELLED and self.has_unlabelled):
            known = (*SPLITS, UNLABELLED) if self.has_unlabelled else SPLITS
            raise ValueError(f"unknown split {split!r} for task {self.name}; expected one of {', '.join(known)}")
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        examples = self._load_all(split, None if data_dir is None else Path(data_dir))
        _check_unique_ids(self.name, split, examples)
        return examples if limit is None else examples[:limit]

    def _load_all(self, split: str, data_dir: Path | None) -> list[Example]:
        searched = self.search_dirs(data_dir)
        for directory, _origin in searched:
            for file_name in self.local_files(split):
                if (directory / file_name).is_file():
                    return self.read_local(split, directory / file_name)
        if data_dir is not None:
            raise DataError(self._missing_message(split, searched, hub_reason=None))
        try:
            return self.read_hub(split)
        except HubUnavailable as exc:
            raise DataError(self._missing_message(split, searched, hub_reason=str(exc))) from exc

    def search_dirs(self, data_dir: Path | None) -> list[tuple[Path, str]]:
        """Directories to look in, each with a note on where it came from."""
        if data_dir is not None:
            return [(data_dir, "--data-dir"), (data_dir / self.name, "--data-dir/<task>")]
        dirs = []
        env = os.environ.get(DATA_DIR_ENV, "").strip()
        if env:
            dirs.append((Path(env) / self.name, f"${DATA_DIR_ENV}/<task>"))
        dirs.append((SHARED_DATA_ROOT / self.name, "shared copy"))
        return dirs

    def hub_rows(self, hub_split: str) -> list[Mapping[str, object]]:
        """All rows of one hub split, or HubUnavailable with the reason."""
        try:
            import datasets  # lazy: optional dependency ("streamfuse[data]")
        except ImportError as exc:
            raise HubUnavailable("the 'datasets' package is not installed (pip install 'streamfuse[data]')") from exc
        try:
            dataset = datasets.load_dataset(self.hub_id, split=hub_split, revision=self.hub_revision)
        # Offline, missing repo/revision and HTTP failures are all OSError
        # subclasses (ConnectionError, HfHubHTTPError, DatasetNotFoundError);
        # ValueError: unknown split/config; RuntimeError: script-only repos,
        # which datasets>=4 refuses to run. Anything else is a real bug.
        except (OSError, ValueError, RuntimeError) as exc:
            raise HubUnavailable(f"datasets.load_dataset({self.hub_id!r}) failed: {type(exc).__name__}: {exc}") from exc
        return [dict(row) for row in dataset]

    def _missing_message(self, split: str, searched: list[tuple[Path, str]], hub_reason: str | None) -> str:
        files = " or ".join(self.local_files(split))
        where = "\n".join(f"  - {d} ({origin}{'' if d.is_dir() else ', does not exist'})" for d, origin in searched)
        hub = (
            "The hub was not tried because --data-dir was given."
            if hub_reason is None
            else f"The hub copy {self.hub_id!r} could not be loaded either: {hub_reason}"
        )
        return (
            f"No data for task {self.name!r}, split {split!r}: looked for {files} in\n{where}\n{hub}\n"
            f"To supply the data, pass --data-dir DIR (or set {DATA_DIR_ENV}=PARENT with a "
            f"{self.name}/ subfolder) where DIR holds:\n{self.data_help}"
        )


def _check_unique_ids(task: str, split: str, examples: Sequence[Example]) -> None:
    """Ids key predictions and caches downstream, so duplicates are a data bug."""
    seen: set[str] = set()
    for example in examples:
        if example.id in seen:
            raise DataError(f"task {task!r}, split {split!r}: duplicate example id {example.id!r}")
        seen.add(example.id)
