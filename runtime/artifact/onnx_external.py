"""The external-data files an ONNX model names, read from its protobuf without the onnx package.

ONNX Runtime opens each initializer's `location` relative to the model's folder; a crafted model could name
`/etc/...` or `../..`. check_external_data refuses any location outside the model's folder (absolute, `..`, a
symbolic link out) before ONNX Runtime opens the model. It walks the messages that can hold tensors: the
graph's initializers, node attributes (the If branches that hold the methods are subgraphs), functions and
training info.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from streamfuse.runtime.artifact.files import ArtifactError, inside

MAX_DEPTH = 64  # nested subgraphs; a deeper model is refused rather than walked
# message -> {field number: message type of that field}, for the fields that lead to tensors (onnx.proto)
MESSAGES = {
    "model": {7: "graph", 25: "function", 20: "training"},
    "training": {1: "graph", 2: "graph"},
    "function": {7: "node"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
    "entry": {},
}
TENSOR_EXTERNAL_DATA, ENTRY_KEY, ENTRY_VALUE = 13, 1, 2


class MalformedModel(ValueError):
    pass


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise MalformedModel("a varint runs past the end")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def fields(data: bytes) -> Iterator[tuple[int, bytes | None]]:
    """(field number, bytes of a length-delimited field or None) for each field of one message."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, at = _varint(data, at)
            yield number, None
        elif wire == 2:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise MalformedModel("a field runs past the end")
            yield number, data[at : at + size]
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
            yield number, None
        else:
            raise MalformedModel(f"wire type {wire}")
    if at != len(data):
        raise MalformedModel("a fixed-size field runs past the end")


def external_locations(data: bytes, message: str = "model", depth: int = 0) -> Iterator[str]:
    """Every external-data location the serialized message names."""
    if depth > MAX_DEPTH:
        raise MalformedModel(f"subgraphs nested deeper than {MAX_DEPTH}")
    if message == "entry":
        entry = {number: value for number, value in fields(data) if value is not None}
        if entry.get(ENTRY_KEY) == b"location":
            yield entry.get(ENTRY_VALUE, b"").decode("utf-8", "replace")
        return
    for number, value in fields(data):
        inner = MESSAGES[message].get(number)
        if inner is not None and value is not None:
            yield from external_locations(value, inner, depth + 1)


def check_external_data(model: Path) -> set[Path]:
    """The external-data files `model` names, each confined to the model's folder; ArtifactError otherwise."""
    model = Path(model)
    try:
        locations = set(external_locations(model.read_bytes()))
    except MalformedModel as error:
        raise ArtifactError(
            f"{model} is not a readable ONNX model ({error}); copy the artifact again or rebuild it"
        ) from None
    return {inside(model.parent, location, "the ONNX external-data location") for location in locations}
