"""Strict readers for local task files.

Every record carries a human-readable location ("file, line N") so that a bad
row in a 78k-line file can be found and fixed without guesswork: all parse and
validation problems surface as :class:`DataError` naming the file and the row.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .base import DataError


@dataclass(frozen=True)
class Row:
    """One input record plus where it came from, for error messages."""

    where: str
    data: Mapping[str, object]

    def text(self, field: str) -> str:
        """The field as a non-empty string, or a DataError saying what is wrong."""
        if field not in self.data or self.data[field] is None:
            present = ", ".join(sorted(str(k) for k in self.data if k is not None))
            raise DataError(f"{self.where}: missing field {field!r} (fields present: {present or 'none'})")
        value = self.data[field]
        if not isinstance(value, str):
            raise DataError(f"{self.where}: field {field!r} must be a string, got {type(value).__name__}")
        if not value.strip():
            raise DataError(f"{self.where}: field {field!r} is empty")
        return value.strip()


def _read_text(path: Path) -> str:
    # utf-8-sig: files saved by spreadsheet tools often start with a BOM, which
    # would otherwise become part of the first column name.
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 text (byte {exc.start})") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read file: {exc}") from exc


def _as_object(where: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def read_jsonl(path: Path) -> list[Row]:
    """One JSON object per line; blank lines are skipped (trailing newlines are common)."""
    rows = []
    for line_no, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {line_no}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        rows.append(Row(where, _as_object(where, value)))
    return rows


def read_json_array(path: Path) -> list[Row]:
    """A single JSON array of objects (the layout of the original hub file)."""
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}, line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON array of objects, got {type(value).__name__}")
    return [Row(f"{path}, element [{i}]", _as_object(f"{path}, element [{i}]", item)) for i, item in enumerate(value)]


def read_csv(path: Path, columns: Sequence[str]) -> list[Row]:
    """A CSV file with a header that must contain *columns*.

    Locations give both the data-row number (1 = first row after the header) and
    the physical line, which differ when quoted fields span several lines.
    """
    reader = csv.DictReader(_read_text(path).splitlines(keepends=True))
    try:
        header = reader.fieldnames or []
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(
                f"{path}: missing CSV column(s) {', '.join(map(repr, missing))}; "
                f"header is {header!r}, expected at least {list(columns)!r}"
            )
        rows = []
        for row_no, record in enumerate(reader, start=1):
            where = f"{path}, row {row_no} (line {reader.line_num})"
            if None in record:  # DictReader files surplus cells under the key None
                raise DataError(f"{where}: more cells than header columns ({len(header)})")
            rows.append(Row(where, record))
        return rows
    except csv.Error as exc:
        raise DataError(f"{path}, line {reader.line_num}: malformed CSV ({exc})") from exc
