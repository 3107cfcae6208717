"""ONNX values other than numeric tensors, on the wire: string tensors, sequences and maps.

ONNX Runtime hands a model's outputs out as numeric arrays (the reply hot path of
`agent.protocol.tensors`), arrays of dtype object holding ``str`` (``tensor(string)``),
lists (``seq(...)``, skl2onnx's ZipMap: a list of ``{label: probability}``) and dicts
(``map(K, V)``). The contract gives each of them one CBOR form:

- ``tensor(string)``: tag 40 over ``[shape, [text, ...]]``, the texts row-major, in both
  directions (a request's input decodes to an object array of ``str``);
- ``seq(T)``: a CBOR array of the elements' forms;
- ``map(K, V)``: a CBOR map, integer or text keys, numbers (or tensors) as values.

Encoding (:func:`encode_value`) is canonical CBOR from cbor2: floats in their shortest exact
form (a float32 probability takes 5 bytes, not 9), map keys sorted. Only outputs that are not
numeric arrays come here, so it is off the hot path. A value with no wire form (complex,
bfloat16 (a numpy void dtype), a set, any other object) raises TypeError naming the output,
its type and where in it the problem lies: the reply stream fails that request with
``model_error``. Decoding (:func:`decode_value`) is the client's inverse.

Builds on `agent.protocol.tensors`, which reaches back here from its two slow paths only
(a string tensor in a request, an output that is not a numeric array) by a late import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import cbor2
import numpy as np

from agent.protocol.errors import Limits, WireError, kind_of, show_value
from agent.protocol.tensors import (
    TENSOR_TAG,
    Array,
    checked_element_count,
    decode_tensor,
    encode_tensor,
    format_dims,
    tensor_error,
)

__all__ = [
    "MAX_NESTING",
    "STRING_DTYPE",
    "decode_string_tensor",
    "decode_value",
    "describe_value",
    "encode_value",
    "is_string_dtype",
    "value_nbytes",
]

STRING_DTYPE = np.dtype(object)  # what ONNX Runtime takes and gives for tensor(string)
MAX_NESTING = 32  # containers inside an output (a ZipMap is 2); deeper is not a model's
_STRING_KINDS = frozenset("OU")  # object (ONNX Runtime's) and numpy's own str arrays
_PLAIN = (bool, int, float, str)  # exact types that are CBOR as they are


def is_string_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether arrays of this dtype travel as string tensors (object or numpy ``str``)."""
    return dtype.kind in _STRING_KINDS


def describe_value(value: Any) -> str:
    """A value's type as messages name it: ``tensor(complex64) [2, 3]``, ``list of 4``."""
    if isinstance(value, np.ndarray):
        kind = "string" if value.dtype == STRING_DTYPE else value.dtype.name
        return f"tensor({kind}) {format_dims(value.shape)}"
    if isinstance(value, (list, tuple, Mapping)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# ------------------------------------------------------------------------------- encoding


class _NoWireForm(Exception):
    """A part of a value with no wire form; ``path`` is filled in on the way out."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str] = []

    def where(self) -> str:
        steps = "".join(reversed(self.path))
        return f"at {steps}: {self.what}" if steps else self.what


def encode_value(value: Any, name: str = "value") -> bytes:
    """Canonical CBOR of one output of any ONNX value type (see the module).

    Raises TypeError naming the output (``name``), its type and the part of it that has no
    wire form: ``output 'p' (list of 3) cannot be encoded: at [0]['a']: complex has no wire
    form``.
    """
    try:
        tree = _wire(value, 0)
    except _NoWireForm as e:
        raise TypeError(
            f"output {show_value(name, 40)} ({describe_value(value)}) cannot be encoded: "
            f"{e.where()}"
        ) from None
    return cbor2.dumps(tree, canonical=True)


def _wire(value: Any, depth: int) -> Any:
    """``value`` as objects cbor2 encodes in the contract's form (tensors as tags)."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, np.ndarray):
        return _array_tag(value)
    if isinstance(value, np.generic):
        return _scalar(value)
    if depth >= MAX_NESTING:
        raise _NoWireForm(f"nested deeper than {MAX_NESTING} containers")
    if isinstance(value, (list, tuple)):
        return [_part(item, depth, f"[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        return {_key(k): _part(v, depth, f"[{show_value(k, 40)}]") for k, v in value.items()}
    raise _NoWireForm(f"{describe_value(value)} has no wire form")


def _part(value: Any, depth: int, step: str) -> Any:
    """An element of a container, its place added to the path of any failure."""
    try:
        return _wire(value, depth + 1)
    except _NoWireForm as e:
        e.path.append(step)
        raise


def _key(key: Any) -> int | str:
    """A map key: integer or text (an ONNX map's key types), numpy's included."""
    if type(key) is str or type(key) is int:
        return key
    if isinstance(key, (np.integer, np.str_)):
        return key.item()
    raise _NoWireForm(f"map key {show_value(key, 40)} ({kind_of(key)}) is not an integer or text")


def _scalar(value: np.generic) -> bool | int | float | str:
    """A numpy scalar inside a sequence or map, as the CBOR number (or text) it is."""
    if isinstance(value, (np.bool_, np.integer, np.str_)) or (
        isinstance(value, np.floating) and value.dtype.itemsize <= 8
    ):
        return value.item()
    raise _NoWireForm(f"{value.dtype.name} has no wire form")


def _array_tag(arr: Array) -> cbor2.CBORTag:
    """A numpy array inside (or as) an output: a numeric tensor, or a string tensor."""
    if arr.dtype.kind in _STRING_KINDS:
        return cbor2.CBORTag(TENSOR_TAG, [list(arr.shape), _texts(arr)])
    try:
        return encode_tensor(arr)
    except TypeError:
        raise _NoWireForm(
            f"dtype {arr.dtype.name} has no wire form (see docs/protocol.md, Tensors)"
        ) from None


def _texts(arr: Array) -> list[str]:
    """A string tensor's elements, row-major; each must be text."""
    texts: list[Any] = arr.ravel().tolist()
    for i, text in enumerate(texts):
        if type(text) is not str:
            if not isinstance(text, str):
                raise _NoWireForm(f"element {i} of a string tensor is {kind_of(text)}, not text")
            texts[i] = str(text)
    return texts


def value_nbytes(value: Any) -> int:
    """About the bytes a value takes on the wire, for a reply budget counted before encoding:
    an array's ``nbytes``, 9 a scalar, the sum over a container's items."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, Mapping):
        return sum(9 + value_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(value_nbytes(v) for v in value)
    if isinstance(value, (str, bytes)):
        return len(value)
    return 9


# ------------------------------------------------------------------------------- decoding


def decode_string_tensor(
    shape: tuple[int, ...],
    items: Sequence[Any],
    limits: Limits,
    name: str,
    request_id: str | None,
) -> Array:
    """A string tensor's texts (``[shape, [text, ...]]``) as an object array of ``str``.

    ``shape`` was checked by :func:`agent.protocol.tensors.decode_request_tensor` (rank,
    dims); here the element count and the texts' UTF-8 bytes are held to the limits, and
    every element must be text, as many as the shape holds.
    """
    count = checked_element_count(shape, limits, name, request_id)
    if len(items) != count:
        raise tensor_error(
            name,
            request_id,
            f"shape {format_dims(shape)} of string needs {count} texts, got {len(items)}",
        )
    nbytes = 0
    for i, text in enumerate(items):
        if type(text) is not str:
            raise tensor_error(
                name, request_id, f"element {i} of a string tensor is {kind_of(text)}, not text"
            )
        nbytes += len(text) if text.isascii() else len(text.encode())
    if nbytes > limits.max_tensor_bytes:
        raise tensor_error(
            name,
            request_id,
            f"{count} texts of {nbytes} UTF-8 bytes, over the limit of {limits.max_tensor_bytes}",
            "too_large",
        )
    arr: Array = np.empty(count, dtype=STRING_DTYPE)
    arr[:] = items
    return arr.reshape(shape)


def decode_value(obj: Any, limits: Limits, *, name: str = "value", depth: int = 0) -> Any:
    """A decoded CBOR output as the value a model gave: tensors (numeric or string) as numpy
    arrays, arrays as lists, maps as dicts (their tensors decoded too), numbers and text as
    they are; a tag that is not a tensor is left a ``CBORTag`` (a newer agent's form).

    Raises :class:`WireError` for a malformed tensor, or nesting past ``limits.max_depth``.
    """
    if isinstance(obj, cbor2.CBORTag):
        if obj.tag == TENSOR_TAG or 64 <= obj.tag <= 87:
            return decode_tensor(obj, limits, name=name)
        return obj
    if depth >= limits.max_depth:
        raise WireError("bad_request", f"output {show_value(name, 40)} is nested too deeply")
    if isinstance(obj, (list, tuple)):
        return [decode_value(item, limits, name=name, depth=depth + 1) for item in obj]
    if isinstance(obj, Mapping):
        return {k: decode_value(v, limits, name=name, depth=depth + 1) for k, v in obj.items()}
    return obj
