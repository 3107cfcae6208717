"""CBOR payloads of the contract, and the guard every MQTT payload passes first.

Everything that arrives from MQTT passes through :func:`decode_payload` before any other part of
the agent sees it, so this is where hostile input is stopped. The order of the checks is the
point:

1. the raw size, before anything is read (``too_large``);
2. zstd frames: the declared content size before decompressing, then a hard cap on the output;
3. a header-only walk of the CBOR (:func:`agent.protocol.cbor_scan.scan_map`) that bounds
   nesting, map sizes and the number of items *before* cbor2 builds a single Python object, and
   that reads the request ``id`` on the way, so that even a request refused for its shape can be
   answered (small payloads are decoded first and checked on the objects, see
   :data:`DECODE_FIRST_BYTES`);
4. cbor2 decodes, with every tag kept as a plain :class:`cbor2.CBORTag` (no dates, regexes,
   shared references or other objects the protocol never asked for);
5. tensors are checked later, by `agent.protocol.tensors`, against the limits from their shape
   alone, and only then wrapped, zero copy, around the bytes cbor2 already holds.

Every failure is a :class:`agent.protocol.errors.WireError` carrying one of the contract's
error codes.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping
from typing import Any

import cbor2
import numpy as np
import zstandard

from agent.protocol.cbor_scan import STRUCTURAL_TAGS, scan_map
from agent.protocol.errors import Limits, WireError, show_value
from agent.protocol.tensors import TENSOR_TAG, encode_tensor

__all__ = ["DECODE_FIRST_BYTES", "ZSTD_MAGIC", "decode_payload", "encode_payload", "zstd_frame"]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SELF_DESCRIBED = b"\xd9\xd9\xf7"  # tag 55799 (RFC 8949 §3.4.6): "this is CBOR", no meaning
_PEEK_ITEMS = 64  # how far an id is looked for in a payload refused before decoding
_PEEK_DECOMPRESSED = 4096  # bytes of a refused zstd frame decompressed to look for the id
_PEEK_WINDOW = 1 << 23  # the zstd window that peek allows (level 19 uses 8 MB)


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
        return scan_map(buf, max_depth=64, max_map_keys=1 << 62, max_items=_PEEK_ITEMS)
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


def zstd_frame(data: bytes) -> bytes:
    """`data` as one zstd frame (level 3, its content size written), with this thread's
    compressor: what `encode_payload` and a reply's `params.reply_compression` send."""
    packed: bytes = _compressor().compress(data)
    return packed


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
    for tag in (*_BUILTIN_TAGS, *(t for t in (TENSOR_TAG, *range(64, 88)) if _decoded_natively(t)))
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
# (`_decode_small`): for a small request the header walk (`scan_map`) cost three times the
# decoding itself, and what such a payload decodes to is bounded by its size (at most one
# item a byte). Any failure falls back to the walk, which gives the precise error and the id.
DECODE_FIRST_BYTES = 4096
_FROZEN_MAP = type(cbor2.loads(b"\xa1\xa0\x00").popitem()[0])  # a map used as a map key
_NESTING = frozenset({dict, list, tuple, cbor2.CBORTag, _FROZEN_MAP})


def _decode_small(buf: memoryview, limits: Limits) -> dict[str, Any] | None:
    """The decoded map when it holds every rule `scan_map` enforces, else None. cbor2 checks
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
            if item.tag in STRUCTURAL_TAGS:
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

    Tags, tensors included, stay :class:`cbor2.CBORTag` objects (see
    :func:`agent.protocol.tensors.decode_tensor`). Raises :class:`WireError`: ``too_large``
    for the size limits, ``bad_request`` otherwise, with ``request_id`` set whenever the id
    could be read.
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
    request_id = scan_map(
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
                "bad_request", f"the payload's keys must be text, got {show_value(key)}", request_id
            )
    return obj


def _encode_default(encoder: cbor2.CBOREncoder, value: Any) -> None:
    """numpy values anywhere in a payload: arrays as tensors, scalars as CBOR numbers."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "OU":  # string tensors
        encoder.encode(cbor2.CBORTag(TENSOR_TAG, [list(value.shape), value.ravel().tolist()]))
    elif isinstance(value, np.ndarray):
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
        packed = zstd_frame(data)
        if len(packed) < len(data):
            return packed
    return data
