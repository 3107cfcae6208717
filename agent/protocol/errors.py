"""What every part of the protocol shares: the contract's error codes and :class:`WireError`,
the :class:`Limits` on outside input, the contract's constants, and the helpers that keep
error messages one bounded line.

Every refusal of outside input in the agent is a :class:`WireError` carrying one of
:data:`ERROR_CODES`; the other protocol modules (`payload`, `tensors`, `requests`) raise it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import cbor2

__all__ = [
    "ERROR_CODES",
    "ID_PATTERN",
    "MAX_REPLY_TO_CHARS",
    "PROTOCOL_VERSION",
    "Limits",
    "WireError",
    "is_cbor_int",
    "kind_of",
    "show_value",
]

ERROR_CODES = frozenset(
    {
        "bad_request",
        "unknown_model",
        "unknown_version",
        "too_large",
        "overloaded",
        "deadline_exceeded",
        "model_error",
        "shutting_down",
    }
)
# `\Z`, not `$`: `$` also matches before a trailing newline, and "abc\n" is not an id.
# Anchored at both ends, so `.match()` is as safe as `.fullmatch()` for callers.
ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")

PROTOCOL_VERSION = 1
MAX_REPLY_TO_CHARS = 256

_MESSAGE_CHARS = 300


class WireError(Exception):
    """A payload or request the agent refuses.

    ``code`` is one of :data:`ERROR_CODES`, ``message`` one readable line for the requester,
    ``request_id`` the request's id where it could be read (``None``: the request gets no reply,
    only a count on the events topic, as the contract says).
    """

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown error code {code!r}")
        message = _one_line(message)
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """Bounds on outside input; each is enforced before the work or memory it protects.

    ``max_items`` (an addition to the other limits) bounds the CBOR data items of one payload:
    16 MB of one-byte empty arrays would otherwise become 16 million Python lists.
    """

    max_payload_bytes: int = 4 * 1024 * 1024  # raw MQTT payload, checked before any decoding
    max_decompressed_bytes: int = 16 * 1024 * 1024  # zstd output, declared and actual
    max_depth: int = 8  # containers (arrays, maps, tags) around any CBOR item
    max_map_keys: int = 64  # keys in any one map
    max_tensor_elements: int = 16 * 1024 * 1024
    max_tensor_bytes: int = 64 * 1024 * 1024
    max_rank: int = 8
    max_tensors: int = 32
    max_items: int = 65536  # CBOR data items in one payload
    max_image_pixels: int = 40_000_000  # an encoded image input, from its header

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive integer, got {value!r}")


# ------------------------------------------------------------------------------- helpers


def _one_line(text: str) -> str:
    """Messages go back to requesters and into logs: one line, bounded."""
    line = " ".join(str(text).split())
    return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."


def show_value(value: object, limit: int = 64) -> str:
    """A requester-supplied value quoted for a message: escaped (no newlines), and short. A
    bignum (CBOR tags 2 and 3, kept as tags by the decoder) is shown as the integer it is."""
    if isinstance(value, cbor2.CBORTag) and value.tag in (2, 3) and isinstance(value.value, bytes):
        magnitude = int.from_bytes(value.value[:64], "big")  # 512 bits: more is only digits
        value = magnitude if value.tag == 2 else -1 - magnitude
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_cbor_int(value: object) -> bool:
    """CBOR integers only: Python's ``bool`` is an ``int``, but ``true`` is not a number."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def kind_of(value: object) -> str:
    """What a value is, for a message: a tag by its number, anything else by its type."""
    if isinstance(value, cbor2.CBORTag):
        return f"tag {value.tag}"
    return type(value).__name__
