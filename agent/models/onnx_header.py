"""The top-level fields of an ONNX file (producer, opsets, metadata_props), read by hand.

Hand-written rather than ``onnx.load``: importing ``onnx`` costs some 13 MB of RSS on a small
box, and parsing a model parses its graph, hundreds of MB for a large one, only to read a few
strings. The ``ModelProto`` fields wanted here sit outside the graph, and protobuf lets a
reader skip a field by its length, so the file is mapped (``mmap``: pages never touched are
never read) and its top-level fields walked, the graph (field 7) and functions jumped over.

Wire format (protobuf): each field is a varint key ``number << 3 | wire_type``, then a varint
(type 0), 8 bytes (1), a varint length and that many bytes (2) or 4 bytes (5). Fields read:
ir_version=1, producer_name=2, producer_version=3, domain=4, model_version=5,
opset_import=8 (repeated ``OperatorSetIdProto{domain=1, version=2}``), metadata_props=14
(repeated ``StringStringEntryProto{key=1, value=2}``).

Robust by construction: any malformed or truncated field ends the walk and what was read
before it is kept; every loop advances by at least one byte and is capped in count; strings
are cut before they are decoded. :func:`read_header` never raises.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_PROPS",
    "MAX_TEXT",
    "ML_DOMAIN",
    "OnnxHeader",
    "model_metadata",
    "parse_header",
    "read_header",
]

MAX_PROPS = 32  # metadata_props entries kept (the rest are counted)
MAX_TEXT = 256  # characters kept of every string (keys, values, producer, ...)
MAX_OPSETS = 64  # opset_import entries kept
MAX_FIELDS = 100_000  # top-level fields walked: a real model has a few dozen
MAX_ENTRY_FIELDS = 16  # fields walked in one opset or property entry (2 are defined)
ML_DOMAIN = "ai.onnx.ml"
_DEFAULT_DOMAINS = ("", "ai.onnx")
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


_Buffer = bytes | mmap.mmap  # what is walked: a mapped file, or bytes in tests


class _Malformed(Exception):
    """The bytes stop making sense (or stop): end the walk, keep what was read."""


@dataclass
class OnnxHeader:
    """What :func:`parse_header` found; ``complete`` is False when the walk stopped early."""

    ir_version: int | None = None
    producer_name: str = ""
    producer_version: str = ""
    domain: str = ""
    model_version: int | None = None
    opsets: dict[str, int] = field(default_factory=dict)  # domain -> version
    props: dict[str, str] = field(default_factory=dict)  # at most MAX_PROPS, cut
    props_total: int = 0  # metadata_props entries in the file
    complete: bool = True

    @property
    def opset(self) -> int | None:
        """The default domain's opset (``""`` or ``ai.onnx``)."""
        for name in _DEFAULT_DOMAINS:
            if name in self.opsets:
                return self.opsets[name]
        return None

    def metadata(self) -> dict[str, Any]:
        """The inventory's ``metadata`` (docs/protocol.md, Inventory)."""
        result: dict[str, Any] = {
            "producer": self.producer_name,
            "producer_version": self.producer_version,
            "domain": self.domain,
            "opset": self.opset,
        }
        if ML_DOMAIN in self.opsets:
            result["opset_ml"] = self.opsets[ML_DOMAIN]
        result["props"] = dict(self.props)
        if self.props_total > len(self.props):
            result["props_omitted"] = self.props_total - len(self.props)
        return result


def read_header(path: Path | str) -> OnnxHeader | None:
    """The header of the ONNX file at ``path``, or None if it cannot be read or holds none."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return parse_header(m)
    except (OSError, ValueError):  # ValueError: an empty file cannot be mapped
        return None


def model_metadata(path: Path | str) -> dict[str, Any] | None:
    """:meth:`OnnxHeader.metadata` of the file at ``path``, or None."""
    header = read_header(path)
    return None if header is None else header.metadata()


def parse_header(buf: _Buffer) -> OnnxHeader | None:
    """Walk the top-level fields of a serialized ``ModelProto``; None if none was readable."""
    header = OnnxHeader()
    pos, end, known = 0, len(buf), 0
    try:
        for _ in range(MAX_FIELDS):
            if pos >= end:
                break
            number, wire, pos = _key(buf, pos, end)
            start, pos = _skip(buf, pos, end, wire)
            known += _apply(header, buf, number, wire, start, pos)
        else:
            header.complete = pos >= end
    except _Malformed:
        header.complete = False
    return header if known else None


_INT_FIELDS = {1: "ir_version", 5: "model_version"}
_TEXT_FIELDS = {2: "producer_name", 3: "producer_version", 4: "domain"}
_OPSET_IMPORT, _METADATA_PROPS = 8, 14


def _apply(header: OnnxHeader, buf: _Buffer, number: int, wire: int, a: int, b: int) -> bool:
    """Store one top-level field (``buf[a:b]`` its value); False for a field not read here."""
    if number in _INT_FIELDS:
        _expect(wire, _VARINT)
        setattr(header, _INT_FIELDS[number], _signed64(_varint(buf, a, b)[0]))
    elif number in _TEXT_FIELDS:
        _expect(wire, _LENGTH)
        setattr(header, _TEXT_FIELDS[number], _text(buf, a, b))
    elif number == _OPSET_IMPORT:
        _expect(wire, _LENGTH)
        entry = _entry(buf, a, b)
        if len(header.opsets) < MAX_OPSETS:
            header.opsets[_text_of(entry.get(1))] = _int_of(entry.get(2))
    elif number == _METADATA_PROPS:
        _expect(wire, _LENGTH)
        header.props_total += 1
        if len(header.props) < MAX_PROPS:
            entry = _entry(buf, a, b)
            header.props[_text_of(entry.get(1))] = _text_of(entry.get(2))
    else:
        return False
    return True


def _expect(wire: int, wanted: int) -> None:
    if wire != wanted:
        raise _Malformed


def _entry(buf: _Buffer, pos: int, end: int) -> dict[int, str | int]:
    """An opset or property entry: field number -> text (length) or int (varint)."""
    found: dict[int, str | int] = {}
    for _ in range(MAX_ENTRY_FIELDS):
        if pos >= end:
            break
        number, wire, pos = _key(buf, pos, end)
        start, pos = _skip(buf, pos, end, wire)
        if wire == _LENGTH:
            found[number] = _text(buf, start, pos)
        elif wire == _VARINT:
            found[number] = _signed64(_varint(buf, start, pos)[0])
    return found


def _text_of(value: str | int | None) -> str:
    return value if isinstance(value, str) else ""


def _int_of(value: str | int | None) -> int:
    return value if isinstance(value, int) else 0


def _key(buf: _Buffer, pos: int, end: int) -> tuple[int, int, int]:
    """A field key: (field number, wire type, position after it)."""
    key, pos = _varint(buf, pos, end)
    number, wire = key >> 3, key & 7
    if number == 0 or wire not in (_VARINT, _FIXED64, _LENGTH, _FIXED32):
        raise _Malformed  # field 0 does not exist; groups (3, 4) are not in ONNX
    return number, wire, pos


def _skip(buf: _Buffer, pos: int, end: int, wire: int) -> tuple[int, int]:
    """(start of the value, position after it) of a field whose key ended at ``pos``."""
    if wire == _VARINT:
        return pos, _varint(buf, pos, end)[1]
    if wire == _LENGTH:
        length, start = _varint(buf, pos, end)
        after = start + length
    else:
        start, after = pos, pos + (8 if wire == _FIXED64 else 4)
    if after > end:
        raise _Malformed  # truncated
    return start, after


def _varint(buf: _Buffer, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it); at most 10 bytes, as protobuf allows."""
    value = shift = 0
    for i in range(pos, min(end, pos + 10)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise _Malformed


def _signed64(value: int) -> int:
    """An int64 field's varint as a signed number (negatives take 10 bytes, two's complement)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(buf: _Buffer, start: int, end: int) -> str:
    """A string field, cut to MAX_TEXT characters (at most 4 bytes each are decoded)."""
    raw = buf[start : min(end, start + 4 * MAX_TEXT)]
    return bytes(raw).decode("utf-8", errors="replace")[:MAX_TEXT]
