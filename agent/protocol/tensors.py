"""RFC 8746 tensors: numpy arrays to and from CBOR tags, and the hand-built CBOR of replies.

Decoding checks a tensor against the :class:`Limits` from its shape alone, before anything is
allocated, and only then wraps the bytes cbor2 already holds (zero copy). Encoding goes two
ways: :func:`encode_tensor` makes the ``CBORTag`` that cbor2 encodes anywhere in a payload,
and :func:`outputs_pieces` (the reply hot path) writes the same bytes by hand around each
array's own buffer, so that a reply copies its tensor data once, into the payload.

Numeric tensors only. The other ONNX values (string tensors, sequences, maps) are
`agent.protocol.values`', reached from here on two slow paths only, by a late import (values
builds on this module): a tensor whose data is an array of text (a string tensor), and an
output that is not a numeric array. A numeric array never goes near them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import cbor2
import numpy as np
import numpy.typing as npt

from agent.protocol.errors import Limits, WireError, is_cbor_int, kind_of, show_value
from agent.protocol.images import encoded_image

__all__ = [
    "TENSOR_TAG",
    "Array",
    "cbor_text",
    "cbor_uint",
    "checked_element_count",
    "decode_request_tensor",
    "decode_tensor",
    "element_count",
    "encode_outputs",
    "encode_tensor",
    "format_dims",
    "outputs_pieces",
    "tensor_error",
    "typed_array_dtypes",
]

Array = npt.NDArray[Any]

TENSOR_TAG = 40  # RFC 8746 multi-dimensional array, row-major

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
    return cbor2.CBORTag(TENSOR_TAG, [arr.shape, cbor2.CBORTag(tag, arr.tobytes())])


def decode_tensor(obj: Any, limits: Limits, *, name: str = "tensor") -> Array:
    """An RFC 8746 tensor (or a bare typed array, as 1-D) as a read-only numpy view.

    The shape is checked against the limits before anything is allocated, so a shape of 2^40
    elements costs a few multiplications. The array wraps the bytes cbor2 decoded (zero copy);
    big-endian data is converted to the host's order, which is the only copy made. A string
    tensor (tag 40 over ``[shape, [text, ...]]``) becomes a numpy array of dtype object
    holding ``str`` (see :func:`agent.protocol.values.decode_string_tensor`).
    """
    return decode_request_tensor(obj, limits, name, None)


def tensor_error(
    name: str, request_id: str | None, message: str, code: str = "bad_request"
) -> WireError:
    """A tensor's refusal, its message naming the tensor (a request's input, mostly)."""
    return WireError(code, f"tensor {show_value(name)}: {message}", request_id)


def decode_request_tensor(obj: Any, limits: Limits, name: str, request_id: str | None) -> Array:
    """:func:`decode_tensor` for an input of a request: its errors carry the request's id."""
    # Errors are built by a module function, not a closure made on every call: on the
    # network thread's path this function runs once per input of every request.
    if type(obj) is bytes:  # a JPEG or PNG (for an input with [preprocess])
        return encoded_image(obj, limits, name, request_id)
    if type(obj) is str:  # a bare text (a generate model's `prompt`): a string tensor [1]
        text = np.empty((1,), dtype=object)
        text[0] = obj
        return text
    if not isinstance(obj, cbor2.CBORTag):
        raise tensor_error(
            name,
            request_id,
            f"not an RFC 8746 tensor (tag 40 over [shape, typed array]), got {kind_of(obj)}",
        )
    shape: tuple[int, ...] | None
    if obj.tag == TENSOR_TAG:
        value = obj.value
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise tensor_error(name, request_id, "tag 40 must hold [shape, typed array]")
        dims, typed = value
        if not isinstance(dims, (list, tuple)):
            raise tensor_error(
                name, request_id, f"the shape must be an array of dimensions, got {kind_of(dims)}"
            )
        if len(dims) > limits.max_rank:
            raise tensor_error(
                name, request_id, f"rank {len(dims)} exceeds the limit of {limits.max_rank}"
            )
        for d in dims:
            if not is_cbor_int(d) or d < 0:
                raise tensor_error(
                    name, request_id, f"dimension {show_value(d)} is not a non-negative integer"
                )
            if d > limits.max_tensor_elements:
                raise tensor_error(
                    name,
                    request_id,
                    f"dimension {d} exceeds the limit of {limits.max_tensor_elements} elements",
                    "too_large",
                )
        shape = tuple(dims)
    elif 64 <= obj.tag <= 87:
        shape, typed = None, obj
    else:
        raise tensor_error(
            name, request_id, f"tag {obj.tag} is not a tensor (tag 40, or a typed array 64-87)"
        )

    if not isinstance(typed, cbor2.CBORTag) or not 64 <= typed.tag <= 87:
        if shape is not None and isinstance(typed, (list, tuple)):  # [shape, [text, ...]]
            from agent.protocol.values import decode_string_tensor  # the slow path: see above

            return decode_string_tensor(shape, typed, limits, name, request_id)
        raise tensor_error(
            name,
            request_id,
            "the data must be an RFC 8746 typed array (tags 64-87 over a byte string) or, "
            "for a string tensor, an array of text strings",
        )
    dtype = _TAG_DTYPES.get(typed.tag)
    if dtype is None:
        raise tensor_error(
            name, request_id, f"typed array tag {typed.tag}: {_UNSUPPORTED_TAGS[typed.tag]}"
        )
    raw = typed.value
    if not isinstance(raw, (bytes, bytearray)):
        raise tensor_error(
            name,
            request_id,
            f"typed array tag {typed.tag} must hold a byte string, got {kind_of(raw)}",
        )
    nbytes = len(raw)
    itemsize = dtype.itemsize

    if shape is None:
        if nbytes % itemsize:
            raise tensor_error(
                name, request_id, f"{nbytes} bytes is not a whole number of {dtype.name} elements"
            )
        shape = (nbytes // itemsize,)
    elements = checked_element_count(shape, limits, name, request_id)
    need = elements * itemsize
    if need > limits.max_tensor_bytes:
        raise tensor_error(
            name,
            request_id,
            f"shape {format_dims(shape)} of {dtype.name} needs {need} bytes, over the limit of "
            f"{limits.max_tensor_bytes}",
            "too_large",
        )
    if nbytes != need:
        raise tensor_error(
            name,
            request_id,
            f"shape {format_dims(shape)} of {dtype.name} needs {need} bytes, got {nbytes}",
        )

    arr: Array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if not dtype.isnative:
        arr = arr.astype(_NATIVE_DTYPES[typed.tag])
    return arr


def checked_element_count(
    shape: Sequence[int], limits: Limits, name: str, request_id: str | None
) -> int:
    """The elements ``shape`` holds; ``too_large`` past the limit (numeric or text)."""
    elements = element_count(shape, limits.max_tensor_elements)
    if elements > limits.max_tensor_elements:
        raise tensor_error(
            name,
            request_id,
            f"shape {format_dims(shape)} exceeds the limit of "
            f"{limits.max_tensor_elements} elements",
            "too_large",
        )
    return elements


def element_count(shape: Sequence[int], limit: int) -> int:
    """The product of the dims, stopping as soon as it passes ``limit`` (unless a dim is 0):
    a hostile shape costs a few multiplications, never a huge integer."""
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
        if count > limit:
            return count
    return count


def format_dims(shape: Sequence[int]) -> str:
    """A shape as error messages write it: ``[2, 3]``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


# ------------------------------------------------------------------------------- replies
# The hot path: replies built from pieces, tensor data copied once, into the payload.


def encode_outputs(outputs: Mapping[str, Any]) -> bytes:
    """CBOR of ``{name: value}``: a reply's ``outputs``, or the bytes its parts carry.

    For numeric arrays the same bytes as ``cbor2.dumps({name: encode_tensor(arr)})``, built
    from each array's own buffer with one copy (into the result); any other value as
    :func:`agent.protocol.values.encode_value` writes it (TypeError where it has no form).
    """
    pieces, _ = outputs_pieces(outputs)
    return b"".join(pieces)


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
            _head(6, TENSOR_TAG),
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


def outputs_pieces(outputs: Mapping[str, Any]) -> tuple[list[Any], int]:
    """The CBOR of ``{name: value}`` as pieces for one ``b"".join`` (heads as bytes, data
    as the arrays themselves), and its length: a reply is assembled around them with a
    single copy of the tensor data.

    A numeric array takes the hand-built way; anything else (a string tensor, a list, a
    dict, a dtype with no tag) fails its head and goes to :func:`_other_output`, which
    encodes it or raises TypeError naming the output and its type."""
    pieces: list[Any] = [_head(5, len(outputs))]
    size = len(pieces[0])
    for name, arr in outputs.items():
        text = cbor_text(name)
        try:
            head, convert = _tensor_head(arr)
        except (TypeError, AttributeError):  # no dtype, or one with no tag: not numeric
            data = _other_output(name, arr)
            pieces += (text, data)
            size += len(text) + len(data)
            continue
        if convert is not None:
            arr = arr.view(convert) if convert is _UINT8 else arr.astype(convert)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        pieces += (text, head, arr)
        size += len(text) + len(head) + arr.nbytes
    return pieces, size


def _other_output(name: str, value: Any) -> bytes:
    """The CBOR of an output that is not a numeric array (the slow path, see the module)."""
    from agent.protocol.values import encode_value

    return encode_value(value, name)
