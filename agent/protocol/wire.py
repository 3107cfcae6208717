"""The wire format of the contract: CBOR payloads, RFC 8746 tensors, requests and replies.

Everything that arrives from MQTT passes through here before any other part of the agent sees
it, so this module is where hostile input is stopped. The order of the checks is the point:

1. the raw size, before anything is read (``too_large``);
2. zstd frames: the declared content size before decompressing, then a hard cap on the output;
3. a header-only walk of the CBOR (:func:`_scan`) that bounds nesting, map sizes and the number
   of items *before* cbor2 builds a single Python object, and that reads the request ``id``
   on the way, so that even a request refused for its shape can be answered;
4. cbor2 decodes, with every tag kept as a plain :class:`cbor2.CBORTag` (no dates, regexes,
   shared references or other objects the protocol never asked for);
5. tensors are checked against the limits from their shape alone, and only then wrapped, zero
   copy, around the bytes cbor2 already holds.

Every failure is a :class:`WireError` carrying one of the contract's error codes.
"""

from __future__ import annotations

import functools
import io
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import cbor2
import numpy as np
import numpy.typing as npt
import zstandard

if TYPE_CHECKING:
    from agent.models.backends.base import TensorSpec

__all__ = [
    "ERROR_CODES",
    "ID_PATTERN",
    "ZSTD_MAGIC",
    "Limits",
    "Request",
    "WireError",
    "cbor_text",
    "cbor_uint",
    "decode_payload",
    "decode_tensor",
    "encode_outputs",
    "encode_payload",
    "encode_tensor",
    "gone_message",
    "outputs_pieces",
    "parse_request",
    "read_request_id",
    "reassemble_parts",
    "reply_envelope",
    "split_parts",
    "validate_inputs",
]

Array = npt.NDArray[Any]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
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
REQUEST_KEYS = frozenset(
    {"id", "inputs", "version", "stream", "priority", "deadline_ms", "qos", "reply_to", "params"}
)
DEFAULT_PRIORITY = 4

_SELF_DESCRIBED = b"\xd9\xd9\xf7"  # tag 55799 (RFC 8949 §3.4.6): "this is CBOR", no meaning
_TENSOR_TAG = 40  # RFC 8746 multi-dimensional array, row-major
# Encoder-side deduplication (value sharing, string references): never used by this protocol,
# and the only tags that could turn a tree into a graph with cycles.
_STRUCTURAL_TAGS = frozenset({25, 28, 29, 256})
_PEEK_ITEMS = 64  # how far an id is looked for in a payload refused before decoding
_PEEK_DECOMPRESSED = 4096  # bytes of a refused zstd frame decompressed to look for the id
_PEEK_WINDOW = 1 << 23  # the zstd window that peek allows (level 19 uses 8 MB)
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


def _show(value: object, limit: int = 64) -> str:
    """A requester-supplied value quoted for a message: escaped (no newlines), and short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: object) -> bool:
    """CBOR integers only: Python's ``bool`` is an ``int``, but ``true`` is not a number."""
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


# ------------------------------------------------------------------------------- tensors

# RFC 8746 §2.1 typed arrays, tag -> numpy dtype with the byte order the tag names.
_TAG_DTYPES: dict[int, np.dtype[Any]] = {
    64: np.dtype("u1"),
    65: np.dtype(">u2"),
    66: np.dtype(">u4"),
    67: np.dtype(">u8"),
    68: np.dtype("u1"),  # uint8, clamped arithmetic: the same bytes
    69: np.dtype("<u2"),
    70: np.dtype("<u4"),
    71: np.dtype("<u8"),
    72: np.dtype("i1"),
    73: np.dtype(">i2"),
    74: np.dtype(">i4"),
    75: np.dtype(">i8"),
    77: np.dtype("<i2"),
    78: np.dtype("<i4"),
    79: np.dtype("<i8"),
    80: np.dtype(">f2"),
    81: np.dtype(">f4"),
    82: np.dtype(">f8"),
    84: np.dtype("<f2"),
    85: np.dtype("<f4"),
    86: np.dtype("<f8"),
}
# The same dtypes in the host's byte order: what decoded arrays are handed out as.
_NATIVE_DTYPES: dict[int, np.dtype[Any]] = {
    tag: dtype.newbyteorder("=") for tag, dtype in _TAG_DTYPES.items()
}


def typed_array_dtypes(tag: int) -> tuple[np.dtype[Any], np.dtype[Any] | None] | None:
    """For a supported typed-array tag: its dtype on the wire, and the host-order dtype that
    decoded arrays are converted to where the wire's byte order is not the host's."""
    dtype = _TAG_DTYPES.get(tag)
    if dtype is None:
        return None
    return dtype, None if dtype.isnative else _NATIVE_DTYPES[tag]


_UNSUPPORTED_TAGS: dict[int, str] = {
    76: "reserved (sint8 has one encoding, tag 72)",
    83: "float128 big-endian is not supported",
    87: "float128 little-endian is not supported",
}
# (dtype kind, itemsize) -> (tag, little-endian wire dtype): what the agent emits.
_ENCODINGS: dict[tuple[str, int], tuple[int, np.dtype[Any]]] = {
    ("b", 1): (64, np.dtype("u1")),  # booleans travel as uint8
    ("u", 1): (64, np.dtype("u1")),
    ("u", 2): (69, np.dtype("<u2")),
    ("u", 4): (70, np.dtype("<u4")),
    ("u", 8): (71, np.dtype("<u8")),
    ("i", 1): (72, np.dtype("i1")),
    ("i", 2): (77, np.dtype("<i2")),
    ("i", 4): (78, np.dtype("<i4")),
    ("i", 8): (79, np.dtype("<i8")),
    ("f", 2): (84, np.dtype("<f2")),
    ("f", 4): (85, np.dtype("<f4")),
    ("f", 8): (86, np.dtype("<f8")),
}
_BOOL = np.dtype(np.bool_)
_UINT8 = np.dtype(np.uint8)


def encode_tensor(arr: Array) -> cbor2.CBORTag:
    """``tag 40 [shape, typed array]``, little-endian, from the array's own buffer.

    A C-contiguous little-endian array costs one copy (the ``bytes`` cbor2 needs; it encodes a
    memoryview as an array of integers). Non-contiguous arrays are gathered by that same copy;
    only a big-endian array needs a second one, to swap its bytes.
    """
    dtype = arr.dtype
    try:
        tag, wire_dtype = _ENCODINGS[(dtype.kind, dtype.itemsize)]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel as an RFC 8746 tensor") from None
    if dtype.kind == "b":
        arr = arr.view(_UINT8)
    elif dtype != wire_dtype:  # big-endian: swap once into the wire's byte order
        arr = arr.astype(wire_dtype)
    return cbor2.CBORTag(_TENSOR_TAG, [arr.shape, cbor2.CBORTag(tag, arr.tobytes())])


def decode_tensor(obj: Any, limits: Limits, *, name: str = "tensor") -> Array:
    """An RFC 8746 tensor (or a bare typed array, as 1-D) as a read-only numpy view.

    The shape is checked against the limits before anything is allocated, so a shape of 2^40
    elements costs a few multiplications. The array wraps the bytes cbor2 decoded (zero copy);
    big-endian data is converted to the host's order, which is the only copy made.
    """
    return _decode_tensor(obj, limits, name, None)


def _tensor_error(
    name: str, request_id: str | None, message: str, code: str = "bad_request"
) -> WireError:
    return WireError(code, f"tensor {_show(name)}: {message}", request_id)


def _decode_tensor(obj: Any, limits: Limits, name: str, request_id: str | None) -> Array:
    # Errors are built by a module function, not a closure made on every call: on the
    # network thread's path this function runs once per input of every request.
    if not isinstance(obj, cbor2.CBORTag):
        raise _tensor_error(
            name,
            request_id,
            f"not an RFC 8746 tensor (tag 40 over [shape, typed array]), got {_kind(obj)}",
        )
    shape: tuple[int, ...] | None
    if obj.tag == _TENSOR_TAG:
        value = obj.value
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise _tensor_error(name, request_id, "tag 40 must hold [shape, typed array]")
        dims, typed = value
        if not isinstance(dims, (list, tuple)):
            raise _tensor_error(
                name, request_id, f"the shape must be an array of dimensions, got {_kind(dims)}"
            )
        if len(dims) > limits.max_rank:
            raise _tensor_error(
                name, request_id, f"rank {len(dims)} exceeds the limit of {limits.max_rank}"
            )
        for d in dims:
            if not _is_int(d) or d < 0:
                raise _tensor_error(
                    name, request_id, f"dimension {_show(d)} is not a non-negative integer"
                )
            if d > limits.max_tensor_elements:
                raise _tensor_error(
                    name,
                    request_id,
                    f"dimension {d} exceeds the limit of {limits.max_tensor_elements} elements",
                    "too_large",
                )
        shape = tuple(dims)
    elif 64 <= obj.tag <= 87:
        shape, typed = None, obj
    else:
        raise _tensor_error(
            name, request_id, f"tag {obj.tag} is not a tensor (tag 40, or a typed array 64-87)"
        )

    if not isinstance(typed, cbor2.CBORTag) or not 64 <= typed.tag <= 87:
        raise _tensor_error(
            name,
            request_id,
            "the data must be an RFC 8746 typed array (tags 64-87 over a byte string)",
        )
    dtype = _TAG_DTYPES.get(typed.tag)
    if dtype is None:
        raise _tensor_error(
            name, request_id, f"typed array tag {typed.tag}: {_UNSUPPORTED_TAGS[typed.tag]}"
        )
    raw = typed.value
    if not isinstance(raw, (bytes, bytearray)):
        raise _tensor_error(
            name,
            request_id,
            f"typed array tag {typed.tag} must hold a byte string, got {_kind(raw)}",
        )
    nbytes = len(raw)
    itemsize = dtype.itemsize

    if shape is None:
        if nbytes % itemsize:
            raise _tensor_error(
                name, request_id, f"{nbytes} bytes is not a whole number of {dtype.name} elements"
            )
        shape = (nbytes // itemsize,)
    elements = _element_count(shape, limits.max_tensor_elements)
    if elements > limits.max_tensor_elements:
        raise _tensor_error(
            name,
            request_id,
            f"shape {_dims(shape)} exceeds the limit of {limits.max_tensor_elements} elements",
            "too_large",
        )
    need = elements * itemsize
    if need > limits.max_tensor_bytes:
        raise _tensor_error(
            name,
            request_id,
            f"shape {_dims(shape)} of {dtype.name} needs {need} bytes, over the limit of "
            f"{limits.max_tensor_bytes}",
            "too_large",
        )
    if nbytes != need:
        raise _tensor_error(
            name,
            request_id,
            f"shape {_dims(shape)} of {dtype.name} needs {need} bytes, got {nbytes}",
        )

    arr: Array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if not dtype.isnative:
        arr = arr.astype(_NATIVE_DTYPES[typed.tag])
    return arr


def _element_count(shape: Sequence[int], limit: int) -> int:
    """The product of the dims, stopping as soon as it passes ``limit`` (unless a dim is 0)."""
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > limit:
            return count
    return count


def _dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _kind(value: object) -> str:
    if isinstance(value, cbor2.CBORTag):
        return f"tag {value.tag}"
    return type(value).__name__


# ------------------------------------------------------------------------------- CBOR scan

_ARRAY, _MAP, _TAG, _BYTE_CHUNKS, _TEXT_CHUNKS = range(5)
_ID_KEY = b"id"


def _scan(buf: memoryview, *, max_depth: int, max_map_keys: int, max_items: int) -> str | None:
    """Walk the item headers of one CBOR map without building anything; return its ``id``.

    cbor2 checks depth, but only bounds map sizes and item counts after it has built the
    objects; this walk reads only headers and skips string bodies in O(1), so its cost is the
    number of items, which it bounds. It also checks well-formedness (RFC 8949 §3, appendix C)
    and that nothing follows the map.

    On the way it remembers the top-level ``id`` when it is a valid id, so that a request
    refused later in the walk, or by cbor2, or by :func:`parse_request`, can still be answered.
    Raises :class:`WireError` (``bad_request``) carrying that id when it was seen first.
    """
    n = len(buf)
    if n == 0:
        raise WireError("bad_request", "the payload is empty")
    if buf[0] >> 5 != 5:
        raise WireError("bad_request", "the payload is not a CBOR map")
    pos = 0
    items = 0
    depth = 0  # open arrays, maps and tags
    # One entry per open container or indefinite-length string.
    kinds: list[int] = []
    left: list[int] = []  # items still expected; -1 for indefinite length
    seen: list[int] = []  # items read so far (a map counts keys and values)
    request_id: str | None = None
    id_next = False  # the top-level key just read was "id"

    def bad(message: str) -> WireError:
        return WireError("bad_request", message, request_id)

    while True:
        if pos >= n:
            raise bad("the CBOR ends in the middle of an item")
        initial = buf[pos]
        pos += 1
        major = initial >> 5
        info = initial & 0x1F

        if initial == 0xFF:  # "break": closes an indefinite-length item
            if not kinds or left[-1] != -1:
                raise bad("malformed CBOR: a break code outside an indefinite-length item")
            if kinds[-1] == _MAP and seen[-1] % 2:
                raise bad("malformed CBOR: a map ends after a key without its value")
            if kinds[-1] <= _TAG:
                depth -= 1
            kinds.pop()
            left.pop()
            seen.pop()
        else:
            items += 1  # chunks of indefinite-length strings count too: each costs a loop
            if items > max_items:
                raise bad(f"the payload holds more than {max_items} CBOR items")
            in_chunks = bool(kinds) and kinds[-1] >= _BYTE_CHUNKS
            if in_chunks:
                want = 2 if kinds[-1] == _BYTE_CHUNKS else 3
                if major != want or info == 31:
                    raise bad("malformed CBOR: a bad chunk in an indefinite-length string")
            elif depth > max_depth:
                raise bad(f"CBOR nesting deeper than {max_depth} levels")
            top_level = depth == 1 and kinds[0] == _MAP and not in_chunks
            if top_level and seen[0] % 2 == 0:
                id_next = False  # a new top-level key starts

            if info < 24:
                arg = info
            elif info < 28:
                size = 1 << (info - 24)
                if pos + size > n:
                    raise bad("the CBOR ends in the middle of an item")
                arg = int.from_bytes(buf[pos : pos + size], "big")
                pos += size
            elif info == 31 and 2 <= major <= 5:
                arg = -1
            else:
                raise bad(f"malformed CBOR: additional information {info} in major type {major}")

            if major == 2 or major == 3:
                if arg == -1:
                    kinds.append(_BYTE_CHUNKS if major == 2 else _TEXT_CHUNKS)
                    left.append(-1)
                    seen.append(0)
                    continue
                if arg > n - pos:
                    raise bad("the CBOR ends in the middle of a string")
                if top_level and major == 3:
                    if seen[0] % 2 == 0:
                        id_next = arg == 2 and buf[pos : pos + 2] == _ID_KEY
                    elif id_next and request_id is None and arg <= 64:
                        candidate = _ascii(buf[pos : pos + arg])
                        if candidate is not None and ID_PATTERN.match(candidate):
                            request_id = candidate
                pos += arg
            elif major == 4 or major == 5:
                if major == 5 and arg > max_map_keys:
                    raise bad(f"a map has {arg} keys, over the limit of {max_map_keys}")
                count = arg if major == 4 or arg == -1 else 2 * arg
                if count > n - pos:  # every item takes at least one byte
                    raise bad("the CBOR ends in the middle of a container")
                if count > max_items - items:
                    raise bad(f"the payload holds more than {max_items} CBOR items")
                if count:
                    kinds.append(_ARRAY if major == 4 else _MAP)
                    left.append(count)
                    seen.append(0)
                    depth += 1
                    continue
            elif major == 6:
                if arg in _STRUCTURAL_TAGS:
                    raise bad(
                        f"CBOR tag {arg} (value sharing or string references) is not accepted"
                    )
                kinds.append(_TAG)
                left.append(1)
                seen.append(0)
                depth += 1
                continue
            elif major == 7 and info == 24 and arg < 32:
                raise bad("malformed CBOR: a simple value in two bytes below 32")
            # Major types 0, 1 and 7, definite strings and empty containers: item complete.

        # An item is complete: count it in its container, closing those it completes.
        while True:
            if not kinds:
                if pos != n:
                    raise bad(f"{n - pos} bytes follow the CBOR map")
                return request_id
            seen[-1] += 1
            if left[-1] == -1:
                if kinds[-1] == _MAP and seen[-1] > 2 * max_map_keys:
                    raise bad(f"a map has more than {max_map_keys} keys")
                break
            left[-1] -= 1
            if left[-1]:
                break
            if kinds[-1] <= _TAG:
                depth -= 1
            kinds.pop()
            left.pop()
            seen.pop()


def _ascii(data: memoryview) -> str | None:
    try:
        return bytes(data).decode("ascii")
    except UnicodeDecodeError:
        return None


def _peek_id(buf: memoryview) -> str | None:
    """The id of a payload refused before decoding: a short walk, never a full decode."""
    if buf[:4] == ZSTD_MAGIC:
        try:
            with _decompressor(_PEEK_WINDOW).stream_reader(buf, read_across_frames=False) as reader:
                head = reader.read(_PEEK_DECOMPRESSED)
        except zstandard.ZstdError:
            return None
        buf = memoryview(head)
    if buf[:3] == _SELF_DESCRIBED:
        buf = buf[3:]
    try:
        return _scan(buf, max_depth=64, max_map_keys=1 << 62, max_items=_PEEK_ITEMS)
    except WireError as e:
        return e.request_id


# ------------------------------------------------------------------------------- zstd

_local = threading.local()  # zstd contexts are not thread-safe; one set per thread


def _decompressor(cap: int) -> zstandard.ZstdDecompressor:
    """A reused context whose window is bounded by ``cap`` (zstd's own default is 128 MB)."""
    window = min(max(cap, 1 << 20), 1 << 27)
    cache: dict[int, zstandard.ZstdDecompressor] | None = getattr(_local, "dctx", None)
    if cache is None:
        cache = _local.dctx = {}
    dctx = cache.get(window)
    if dctx is None:
        dctx = cache[window] = zstandard.ZstdDecompressor(max_window_size=window)
    return dctx


def _compressor() -> zstandard.ZstdCompressor:
    cctx: zstandard.ZstdCompressor | None = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
    return cctx


def _decompress(buf: memoryview, limits: Limits) -> bytes:
    """One zstd frame, decompressed to at most ``max_decompressed_bytes``.

    A declared content size is checked before any work, and then bounds the output buffer
    exactly (zstd fails a frame that lies about it). A frame without one decompresses into a
    buffer of the cap; when that fails, a streaming pass capped at cap + 1 bytes tells a bomb
    (``too_large``) from a corrupt frame (``bad_request``).
    """
    cap = limits.max_decompressed_bytes
    try:
        size = zstandard.frame_content_size(buf)
    except zstandard.ZstdError:
        raise WireError("bad_request", "invalid zstd frame header") from None
    if size > cap:
        raise WireError(
            "too_large",
            f"the zstd frame declares {size} bytes, over the limit of {cap}",
            _peek_id(buf),
        )
    dctx = _decompressor(cap)
    try:
        if size == -1:  # content size not written
            return dctx.decompress(buf, max_output_size=cap, allow_extra_data=False)
        return dctx.decompress(buf, allow_extra_data=False)
    except zstandard.ZstdError as e:
        if size == -1 and _exceeds(dctx, buf, cap):
            raise WireError(
                "too_large", f"the zstd frame holds more than {cap} bytes", _peek_id(buf)
            ) from None
        raise WireError("bad_request", f"invalid zstd frame: {e}") from None


def _exceeds(dctx: zstandard.ZstdDecompressor, buf: memoryview, cap: int) -> bool:
    """Whether the first frame decompresses to more than ``cap`` bytes (reading cap + 1)."""
    total = 0
    try:
        with dctx.stream_reader(buf, read_across_frames=False) as reader:
            while total <= cap:
                chunk = reader.read(min(1 << 20, cap + 1 - total))
                if not chunk:
                    return False
                total += len(chunk)
    except zstandard.ZstdError:
        return False
    return True


# ------------------------------------------------------------------------------- payloads


def _keep_tag(tag: int) -> Callable[[Any, bool], cbor2.CBORTag]:
    def keep(value: Any, immutable: bool) -> cbor2.CBORTag:
        return cbor2.CBORTag(tag, value)

    return keep


# cbor2 6 decodes these tags into Python objects (and 28/29 into shared references); each is
# given a decoder that leaves it a :class:`cbor2.CBORTag`. Every other tag, tensors (40, 64-87)
# included, has no decoder in cbor2 6 and stays a CBORTag without a call into Python: a tensor's
# two tags through Python hooks were a quarter of decoding a small request. A test probes cbor2
# for decoders of any other tag (a newer cbor2 with one fails it), and the import below checks
# the tensor tags, so a cbor2 that gained a decoder for one of them still leaves it raw.
_BUILTIN_TAGS = (
    *(0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261),
    *(1004, 43000, 55799),
)


def _decoded_natively(tag: int) -> bool:
    """Whether cbor2 turns ``tag`` into something other than a CBORTag (or refuses it)."""
    try:
        return not isinstance(cbor2.loads(cbor2.dumps(cbor2.CBORTag(tag, 0))), cbor2.CBORTag)
    except Exception:
        return True


_RAW_TAGS: dict[int, Callable[[Any, bool], cbor2.CBORTag]] = {
    tag: _keep_tag(tag)
    for tag in (*_BUILTIN_TAGS, *(t for t in (_TENSOR_TAG, *range(64, 88)) if _decoded_natively(t)))
}


def _loads_options() -> dict[str, Any]:
    """cbor2 6 options; cbor2 5 (allowed by the dependency range) lacks them."""
    options: dict[str, Any] = {"semantic_decoders": _RAW_TAGS, "allow_duplicate_keys": False}
    try:
        cbor2.loads(b"\xa0", max_depth=1, **options)
    except TypeError:
        return {}
    return options


_LOADS_OPTIONS = _loads_options()
_HAS_MAX_DEPTH = bool(_LOADS_OPTIONS)


# Payloads up to this size are decoded by cbor2 first and their limits checked on the objects
# (`_decode_small`): for a small request the header walk (`_scan`) cost three times the
# decoding itself, and what such a payload decodes to is bounded by its size (at most one
# item a byte). Any failure falls back to the walk, which gives the precise error and the id.
DECODE_FIRST_BYTES = 4096
_FROZEN_MAP = type(cbor2.loads(b"\xa1\xa0\x00").popitem()[0])  # a map used as a map key
_NESTING = frozenset({dict, list, tuple, cbor2.CBORTag, _FROZEN_MAP})


def _decode_small(buf: memoryview, limits: Limits) -> dict[str, Any] | None:
    """The decoded map when it holds every rule `_scan` enforces, else None. cbor2 checks
    well-formedness, UTF-8, duplicate keys and depth (counted as the walk counts it); the
    position after the map shows trailing bytes; the walk over the objects checks the keys
    per map and the refused tags. Items need no count: at most one per byte."""
    if not buf or buf[0] >> 5 != 5:
        return None
    stream = io.BytesIO(buf)
    try:
        obj = cbor2.CBORDecoder(stream, max_depth=limits.max_depth, **_LOADS_OPTIONS).decode()
    except Exception:  # cbor2 raises several types; the walk will name the problem
        return None
    if stream.tell() != buf.nbytes or not isinstance(obj, dict):
        return None
    for key in obj:
        if type(key) is not str:
            return None
    max_keys = limits.max_map_keys
    pending: list[Any] = [obj]
    while pending:  # exact types: the decoder makes no subclasses, and ABC checks are slow
        item = pending.pop()
        kind = type(item)
        if kind is dict or kind is _FROZEN_MAP:
            if len(item) > max_keys:
                return None
            for key, value in item.items():
                if type(key) in _NESTING:
                    pending.append(key)
                if type(value) in _NESTING:
                    pending.append(value)
        elif kind is cbor2.CBORTag:
            if item.tag in _STRUCTURAL_TAGS:
                return None
            if type(item.value) in _NESTING:
                pending.append(item.value)
        else:  # list or tuple
            for value in item:
                if type(value) in _NESTING:
                    pending.append(value)
    return obj


def decode_payload(data: bytes | bytearray | memoryview, limits: Limits) -> dict[str, Any]:
    """One payload of the contract (a CBOR map, or a zstd frame holding one) as a dict.

    Tags, tensors included, stay :class:`cbor2.CBORTag` objects (see :func:`decode_tensor`).
    Raises :class:`WireError`: ``too_large`` for the size limits, ``bad_request`` otherwise,
    with ``request_id`` set whenever the id could be read.
    """
    try:
        buf = memoryview(data).cast("B")
    except TypeError:
        raise WireError("bad_request", "the payload is not a contiguous byte buffer") from None
    size = buf.nbytes
    if size > limits.max_payload_bytes:
        raise WireError(
            "too_large",
            f"payload of {size} bytes, over the limit of {limits.max_payload_bytes}",
            _peek_id(buf),
        )
    if buf[:4] == ZSTD_MAGIC:
        buf = memoryview(_decompress(buf, limits))
    if buf[:3] == _SELF_DESCRIBED:
        buf = buf[3:]
    if buf.nbytes <= min(DECODE_FIRST_BYTES, limits.max_items) and _HAS_MAX_DEPTH:
        decoded = _decode_small(buf, limits)
        if decoded is not None:
            return decoded
        # Something is wrong with it: the walk below says what, with the id where it can.
    request_id = _scan(
        buf,
        max_depth=limits.max_depth,
        max_map_keys=limits.max_map_keys,
        max_items=limits.max_items,
    )
    try:
        if _HAS_MAX_DEPTH:
            obj = cbor2.loads(buf, max_depth=limits.max_depth, **_LOADS_OPTIONS)
        else:  # pragma: no cover - cbor2 5
            obj = cbor2.loads(buf)
    except Exception as e:  # cbor2 raises several types; none may escape
        raise WireError("bad_request", f"invalid CBOR: {e}", request_id) from None
    if not isinstance(obj, dict):  # pragma: no cover - the scan saw a map
        raise WireError("bad_request", "the payload is not a CBOR map", request_id)
    for key in obj:
        if not isinstance(key, str):
            raise WireError(
                "bad_request", f"the payload's keys must be text, got {_show(key)}", request_id
            )
    return obj


def _encode_default(encoder: cbor2.CBOREncoder, value: Any) -> None:
    """numpy values anywhere in a payload: arrays as tensors, scalars as CBOR numbers."""
    if isinstance(value, np.ndarray):
        encoder.encode(encode_tensor(value))
    elif isinstance(value, np.generic):
        encoder.encode(value.item())
    elif isinstance(value, Mapping):
        encoder.encode(dict(value))
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as CBOR")


def encode_payload(obj: Mapping[str, Any], *, compress_over: int | None = None) -> bytes:
    """CBOR of ``obj``, numpy arrays anywhere in it as tensors.

    With ``compress_over``, a CBOR encoding longer than that becomes a zstd frame (its content
    size written, so the receiver can check it before decompressing) when that is smaller:
    random floats do not compress, and a frame that saves nothing only costs the receiver.
    """
    if not isinstance(obj, Mapping):
        raise TypeError(f"a payload is a map, not {type(obj).__name__}")
    data = cbor2.dumps(obj, default=_encode_default)
    if compress_over is not None and len(data) > compress_over:
        packed = _compressor().compress(data)
        if len(packed) < len(data):
            return packed
    return data


# ------------------------------------------------------------------------------- requests


@dataclass
class Request:
    """A request that passed every check of the contract's request table."""

    id: str
    model: str
    inputs: dict[str, Array]
    version: int | None = None
    stream: bool = True
    priority: int = DEFAULT_PRIORITY
    deadline_ms: int | None = None
    qos: int | None = None
    reply_to: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    correlation_data: bytes | None = None


def read_request_id(payload: Mapping[str, Any]) -> str | None:
    """The request's id when present and valid, else ``None`` (it then gets no reply)."""
    if type(payload) is not dict and not isinstance(payload, Mapping):
        return None
    value = payload.get("id")
    if isinstance(value, str) and ID_PATTERN.match(value):
        return value
    return None


def _id_problem(value: object) -> str:
    if value is None:
        return "the request has no id"
    if not isinstance(value, str):
        return f"the id must be text, got {_kind(value)}"
    return f"the id {_show(value)} does not match {ID_PATTERN.pattern}"


def _bad(request_id: str, message: str) -> WireError:
    """A request's `bad_request` (a module function: a closure would be made per request)."""
    return WireError("bad_request", message, request_id)


def _takes(specs: Sequence[TensorSpec]) -> str:
    """What a model takes, for an error message only: describing dtypes is slow."""
    return "; the model takes " + ", ".join(spec.describe() for spec in specs)


def parse_request(
    payload: Mapping[str, Any],
    model: str,
    limits: Limits,
    *,
    allowed_reply_prefixes: Sequence[str],
) -> Request:
    """Check a decoded payload against the contract's request table, key by key.

    A missing or invalid id raises with ``request_id=None`` (no reply is possible); every
    other problem carries the id so the requester hears about it.
    """
    if type(payload) is not dict and not isinstance(payload, Mapping):
        raise WireError("bad_request", "the payload is not a CBOR map")
    request_id = read_request_id(payload)
    if request_id is None:
        raise WireError("bad_request", _id_problem(payload.get("id")))

    if not REQUEST_KEYS.issuperset(payload):
        unknown = [key for key in payload if key not in REQUEST_KEYS]
        names = ", ".join(_show(k, 40) for k in unknown[:5])
        raise _bad(
            request_id, f"unknown key(s) {names}; a request has {', '.join(sorted(REQUEST_KEYS))}"
        )

    if "inputs" not in payload:
        raise _bad(request_id, "the request has no inputs")
    raw_inputs = payload["inputs"]
    if type(raw_inputs) is not dict and not isinstance(raw_inputs, Mapping):
        raise _bad(request_id, f"inputs must be a map of name to tensor, got {_kind(raw_inputs)}")
    if len(raw_inputs) > limits.max_tensors:
        raise _bad(request_id, f"{len(raw_inputs)} inputs, over the limit of {limits.max_tensors}")
    inputs: dict[str, Array] = {}
    for name, value in raw_inputs.items():
        if not isinstance(name, str) or not name:
            raise _bad(request_id, f"input names must be non-empty text, got {_show(name)}")
        inputs[name] = _decode_tensor(value, limits, name, request_id)

    version = payload.get("version")
    if version is not None and (not _is_int(version) or version < 1):
        raise _bad(request_id, f"version must be a positive integer, got {_show(version)}")
    stream = payload.get("stream", True)
    if not isinstance(stream, bool):
        raise _bad(request_id, f"stream must be true or false, got {_show(stream)}")
    priority = payload.get("priority", DEFAULT_PRIORITY)
    if not _is_int(priority) or not 0 <= priority <= 9:
        raise _bad(request_id, f"priority must be an integer from 0 to 9, got {_show(priority)}")
    deadline_ms = payload.get("deadline_ms")
    if deadline_ms is not None and (not _is_int(deadline_ms) or deadline_ms < 0):
        raise _bad(
            request_id, f"deadline_ms must be a non-negative integer, got {_show(deadline_ms)}"
        )
    qos = payload.get("qos")
    if qos is not None and (not _is_int(qos) or qos not in (0, 1, 2)):
        raise _bad(request_id, f"qos must be 0, 1 or 2, got {_show(qos)}")
    reply_to = payload.get("reply_to")
    if reply_to is not None:
        problem = _reply_to_problem(reply_to, allowed_reply_prefixes)
        if problem:
            raise _bad(request_id, problem)
    params = payload.get("params")
    if params is None:
        params = {}
    elif not isinstance(params, Mapping):
        raise _bad(request_id, f"params must be a map, got {_kind(params)}")
    else:
        for key in params:
            if not isinstance(key, str):
                raise _bad(request_id, f"params keys must be text, got {_show(key)}")
        params = dict(params)

    return Request(
        id=request_id,
        model=model,
        inputs=inputs,
        version=version,
        stream=stream,
        priority=priority,
        deadline_ms=deadline_ms,
        qos=qos,
        reply_to=reply_to,
        params=params,
    )


def _reply_to_problem(value: object, prefixes: Sequence[str]) -> str | None:
    """Why ``value`` may not be a reply topic: replies must land where the operator allows."""
    if not isinstance(value, str):
        return f"reply_to must be text, got {_kind(value)}"
    if not value or len(value) > MAX_REPLY_TO_CHARS:
        return f"reply_to must be 1 to {MAX_REPLY_TO_CHARS} characters"
    if "+" in value or "#" in value or "\0" in value:
        return f"reply_to {_show(value)} must not contain MQTT wildcards or NUL"
    if not any(value.startswith(p) for p in prefixes):
        allowed = ", ".join(repr(p) for p in prefixes) or "none configured"
        return f"reply_to {_show(value)} must start with an allowed prefix ({allowed})"
    return None


@functools.lru_cache(maxsize=1024)
def _fixed_dims(shape: tuple[Any, ...]) -> tuple[tuple[int, int], ...]:
    """(axis, size) of a declared shape's fixed dims. Symbolic dims (a name, None, or a
    negative int from some exporters) take any size. Kept per shape: a model declares few."""
    return tuple((axis, dim) for axis, dim in enumerate(shape) if _is_int(dim) and dim >= 0)


def _input(name: str) -> str:
    """An input as error messages name it (built only for an error)."""
    return f"input {_show(name, 40)}"


_ABSENT: Any = object()  # an input the request lacks (None could be a value)


def _input_names_error(
    request_id: str, inputs: Mapping[str, Array], specs: Sequence[TensorSpec]
) -> WireError:
    """The missing (first) or else the unexpected inputs of a request whose input names do
    not match `specs` (called only then: one of the two lists is not empty)."""
    missing = [spec.name for spec in specs if spec.name not in inputs]
    if missing:
        return _bad(
            request_id,
            "missing input(s) " + ", ".join(_show(m, 40) for m in missing) + _takes(specs),
        )
    declared = {spec.name for spec in specs}
    names = ", ".join(_show(name, 40) for name in inputs if name not in declared)
    return _bad(request_id, "unexpected input(s) " + names + _takes(specs))


def validate_inputs(
    request_id: str, inputs: Mapping[str, Array], specs: Sequence[TensorSpec]
) -> dict[str, Array]:
    """Check inputs against a model's declared inputs; return them in declaration order.

    ``specs`` are :class:`agent.models.backends.base.TensorSpec` (name, dtype, shape with int or
    symbolic dims). No dtype is cast implicitly: a silent float64 -> float32 would hide a client
    bug. The one exception is the wire's own: booleans travel as uint8, so uint8 holding only
    0 and 1 is viewed as bool for a bool input.
    """

    if len(inputs) != len(specs):
        raise _input_names_error(request_id, inputs, specs)
    checked: dict[str, Array] = {}
    for spec in specs:
        arr = inputs.get(spec.name, _ABSENT)
        if arr is _ABSENT:
            raise _input_names_error(request_id, inputs, specs)
        if not isinstance(arr, np.ndarray):
            raise _bad(request_id, f"{_input(spec.name)} is not a tensor")
        want = spec.dtype if isinstance(spec.dtype, np.dtype) else np.dtype(spec.dtype)
        if arr.dtype != want:
            if want == _BOOL and arr.dtype == _UINT8:
                if arr.size and int(arr.max()) > 1:
                    raise _bad(
                        request_id, f"{_input(spec.name)} is bool: its uint8 values must be 0 or 1"
                    )
                arr = arr.view(_BOOL)
            else:
                raise _bad(
                    request_id,
                    f"{_input(spec.name)} has dtype {arr.dtype.name}, expected {want.name}",
                )
        if arr.ndim != len(spec.shape):
            raise _bad(
                request_id,
                f"{_input(spec.name)} has rank {arr.ndim} (shape {_dims(arr.shape)}), expected "
                f"rank {len(spec.shape)} ({spec.describe()})",
            )
        shape = arr.shape
        for axis, dim in _fixed_dims(spec.shape):
            if shape[axis] != dim:
                raise _bad(
                    request_id,
                    f"{_input(spec.name)} has {shape[axis]} at axis {axis} (shape "
                    f"{_dims(shape)}), expected {dim} ({spec.describe()})",
                )
        checked[spec.name] = arr
    return checked


# ------------------------------------------------------------------------------- replies


def reply_envelope(
    *, request_id: str, seq: int, type: str, model: str, version: int, **extra: Any
) -> dict[str, Any]:
    """The fields every reply message carries, stamped with the emit time (Unix ns)."""
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "seq": seq,
        "type": type,
        "model": model,
        "version": version,
        "ts": time.time_ns(),
        **extra,
    }


def gone_message(request_id: str) -> dict[str, Any]:
    """The one message a resend of a stream no longer held gets."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "gone", "seq": None}


def encode_outputs(outputs: Mapping[str, Array]) -> bytes:
    """CBOR of ``{name: tensor}``: a reply's ``outputs``, or the bytes its parts carry.

    The same bytes as ``cbor2.dumps({name: encode_tensor(arr)})``, built from each array's own
    buffer with one copy (into the result).
    """
    pieces, _ = outputs_pieces(outputs)
    return b"".join(pieces)


# -- the hot path: replies built from pieces, tensor data copied once, into the payload ------

_U8 = struct.Struct(">BB")
_U16 = struct.Struct(">BH")
_U32 = struct.Struct(">BI")
_U64 = struct.Struct(">BQ")
_SMALL_UINTS = tuple(bytes((n,)) for n in range(24))
_CACHE_LIMIT = 4096  # distinct tensor heads / names kept; past it they are built each time


def _head(major: int, n: int) -> bytes:
    """A CBOR item head: major type and argument, in the shortest form (RFC 8949 §3)."""
    base = major << 5
    if n < 24:
        return bytes((base | n,))
    if n < 0x100:
        return _U8.pack(base | 24, n)
    if n < 0x10000:
        return _U16.pack(base | 25, n)
    if n < 0x100000000:
        return _U32.pack(base | 26, n)
    return _U64.pack(base | 27, n)


def cbor_uint(n: int) -> bytes:
    """CBOR of an unsigned integer (seq, index, ts): the form cbor2 writes, much cheaper."""
    return _SMALL_UINTS[n] if n < 24 else _head(0, n)


_TEXTS: dict[str, bytes] = {}


def cbor_text(text: str) -> bytes:
    """CBOR of a text string, cached for the few names a model has."""
    encoded = _TEXTS.get(text)
    if encoded is None:
        data = text.encode()
        encoded = _head(3, len(data)) + data
        if len(_TEXTS) < _CACHE_LIMIT:
            _TEXTS[text] = encoded
    return encoded


# (dtype, shape) -> (everything of the tensor but its data, the dtype to convert to or None)
_TENSOR_HEADS: dict[tuple[np.dtype[Any], tuple[int, ...]], tuple[bytes, np.dtype[Any] | None]] = {}


def _tensor_head(arr: Array) -> tuple[bytes, np.dtype[Any] | None]:
    key = (arr.dtype, arr.shape)
    found = _TENSOR_HEADS.get(key)
    if found is not None:
        return found
    dtype = arr.dtype
    try:
        tag, wire_dtype = _ENCODINGS[(dtype.kind, dtype.itemsize)]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel as an RFC 8746 tensor") from None
    convert = _UINT8 if dtype.kind == "b" else (wire_dtype if dtype != wire_dtype else None)
    head = b"".join(
        (
            _head(6, _TENSOR_TAG),
            _head(4, 2),
            _head(4, arr.ndim),
            *(_head(0, d) for d in arr.shape),
            _head(6, tag),
            _head(2, arr.size * wire_dtype.itemsize),
        )
    )
    if len(_TENSOR_HEADS) < _CACHE_LIMIT:
        _TENSOR_HEADS[key] = (head, convert)
    return head, convert


def outputs_pieces(outputs: Mapping[str, Array]) -> tuple[list[Any], int]:
    """The CBOR of ``{name: tensor}`` as pieces for one ``b"".join`` (heads as bytes, data
    as the arrays themselves), and its length: a reply is assembled around them with a
    single copy of the tensor data."""
    pieces: list[Any] = [_head(5, len(outputs))]
    size = len(pieces[0])
    for name, arr in outputs.items():
        text = cbor_text(name)
        head, convert = _tensor_head(arr)
        if convert is not None:
            arr = arr.view(convert) if convert is _UINT8 else arr.astype(convert)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        pieces += (text, head, arr)
        size += len(text) + len(head) + arr.nbytes
    return pieces, size


def split_parts(outputs_cbor: bytes, max_data_bytes: int) -> list[bytes]:
    """Contiguous slices of at most ``max_data_bytes``; joined in order they give the input."""
    if max_data_bytes < 1:
        raise ValueError(f"max_data_bytes must be positive, got {max_data_bytes}")
    if len(outputs_cbor) <= max_data_bytes:
        return [bytes(outputs_cbor)]
    return [
        outputs_cbor[i : i + max_data_bytes] for i in range(0, len(outputs_cbor), max_data_bytes)
    ]


# The joined parts are already in memory; the other limits still bound what they decode to.
_PARTS_LIMITS = Limits(max_payload_bytes=1 << 62)


def reassemble_parts(parts: Sequence[bytes], *, limits: Limits | None = None) -> dict[str, Array]:
    """The inverse of :func:`split_parts` + :func:`encode_outputs`, for clients.

    Decodes with the default limits (tensor sizes, depth, keys) but no payload size limit,
    unless ``limits`` says otherwise. Raises :class:`WireError` on malformed data.
    """
    limits = limits or _PARTS_LIMITS
    outputs = decode_payload(b"".join(parts), limits)
    return {name: decode_tensor(value, limits, name=name) for name, value in outputs.items()}
