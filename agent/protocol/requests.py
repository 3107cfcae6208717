"""Requests of the contract: a decoded payload checked against the request table
(:func:`parse_request`), and a request's inputs checked against its model's
(:func:`validate_inputs`).

A request whose id can be read always hears why it was refused: every :class:`WireError` here
carries the id, except the ones for a missing or invalid id (no reply is then possible).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.protocol.errors import (
    ID_PATTERN,
    Limits,
    WireError,
    is_cbor_int,
    kind_of,
    show_value,
)
from agent.protocol.tensors import Array, decode_request_tensor, format_dims
from agent.protocol.topics import ReplyTopics

if TYPE_CHECKING:
    from agent.models.backends.base import TensorSpec

__all__ = [
    "DEFAULT_PRIORITY",
    "REQUEST_KEYS",
    "Request",
    "parse_request",
    "read_request_id",
    "validate_inputs",
]

REQUEST_KEYS = frozenset(
    {"id", "inputs", "version", "stream", "priority", "deadline_ms", "qos", "reply_to", "params"}
)
DEFAULT_PRIORITY = 4
_BOOL = np.dtype(np.bool_)
_UINT8 = np.dtype(np.uint8)  # booleans travel as uint8 (see agent.protocol.tensors)
_STRING = np.dtype(object)  # tensor(string), as ONNX Runtime takes it (agent.protocol.values)
_STRING_FORM = "string (tag 40 over [shape, [text, ...]])"


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
        return f"the id must be text, got {kind_of(value)}"
    return f"the id {show_value(value)} does not match {ID_PATTERN.pattern}"


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
    reply_topics: ReplyTopics,
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
        names = ", ".join(show_value(k, 40) for k in unknown[:5])
        raise _bad(
            request_id, f"unknown key(s) {names}; a request has {', '.join(sorted(REQUEST_KEYS))}"
        )

    if "inputs" not in payload:
        raise _bad(request_id, "the request has no inputs")
    raw_inputs = payload["inputs"]
    if type(raw_inputs) is not dict and not isinstance(raw_inputs, Mapping):
        raise _bad(request_id, f"inputs must be a map of name to tensor, got {kind_of(raw_inputs)}")
    if len(raw_inputs) > limits.max_tensors:
        raise _bad(request_id, f"{len(raw_inputs)} inputs, over the limit of {limits.max_tensors}")
    inputs: dict[str, Array] = {}
    for name, value in raw_inputs.items():
        if not isinstance(name, str) or not name:
            raise _bad(request_id, f"input names must be non-empty text, got {show_value(name)}")
        inputs[name] = decode_request_tensor(value, limits, name, request_id)

    version = payload.get("version")
    if version is not None and (not is_cbor_int(version) or version < 1):
        raise _bad(request_id, f"version must be a positive integer, got {show_value(version)}")
    stream = payload.get("stream", True)
    if not isinstance(stream, bool):
        raise _bad(request_id, f"stream must be true or false, got {show_value(stream)}")
    priority = payload.get("priority", DEFAULT_PRIORITY)
    if not is_cbor_int(priority) or not 0 <= priority <= 9:
        raise _bad(
            request_id, f"priority must be an integer from 0 to 9, got {show_value(priority)}"
        )
    deadline_ms = payload.get("deadline_ms")
    if deadline_ms is not None and (not is_cbor_int(deadline_ms) or deadline_ms < 0):
        raise _bad(
            request_id, f"deadline_ms must be a non-negative integer, got {show_value(deadline_ms)}"
        )
    qos = payload.get("qos")
    if qos is not None and (not is_cbor_int(qos) or qos not in (0, 1, 2)):
        raise _bad(request_id, f"qos must be 0, 1 or 2, got {show_value(qos)}")
    reply_to = payload.get("reply_to")
    if reply_to is not None:
        problem = reply_topics.problem(reply_to)
        if problem:
            raise _bad(request_id, problem)
    params = payload.get("params")
    if params is None:
        params = {}
    elif not isinstance(params, Mapping):
        raise _bad(request_id, f"params must be a map, got {kind_of(params)}")
    else:
        for key in params:
            if not isinstance(key, str):
                raise _bad(request_id, f"params keys must be text, got {show_value(key)}")
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


@functools.lru_cache(maxsize=1024)
def _fixed_dims(shape: tuple[Any, ...]) -> tuple[tuple[int, int], ...]:
    """(axis, size) of a declared shape's fixed dims. Symbolic dims (a name, None, or a
    negative int from some exporters) take any size. Kept per shape: a model declares few."""
    return tuple((axis, dim) for axis, dim in enumerate(shape) if is_cbor_int(dim) and dim >= 0)


def _input(name: str) -> str:
    """An input as error messages name it (built only for an error)."""
    return f"input {show_value(name, 40)}"


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
            "missing input(s) " + ", ".join(show_value(m, 40) for m in missing) + _takes(specs),
        )
    declared = {spec.name for spec in specs}
    names = ", ".join(show_value(name, 40) for name in inputs if name not in declared)
    return _bad(request_id, "unexpected input(s) " + names + _takes(specs))


def _dtype_problem(name: str, got: np.dtype[Any], want: np.dtype[Any]) -> str:
    """Why an input's dtype is refused (built only for an error): string and numeric
    tensors told apart in words, as the wire forms differ."""
    if want == _STRING:  # a string input (else refused for what it is, see _uncarried_type)
        return f"{_input(name)} has dtype {got.name}, expected {_STRING_FORM}"
    if got == _STRING:
        return f"{_input(name)} is a string tensor, expected {want.name}"
    return f"{_input(name)} has dtype {got.name}, expected {want.name}"


def _uncarried_type(spec: TensorSpec) -> str | None:
    """The ONNX type of an input of dtype object that is not a string tensor (bfloat16, a
    sequence, a map); None for a string input."""
    kind = spec.onnx_type
    return None if kind == "tensor(string)" else kind


def validate_inputs(
    request_id: str, inputs: Mapping[str, Array], specs: Sequence[TensorSpec]
) -> dict[str, Array]:
    """Check inputs against a model's declared inputs; return them in declaration order.

    ``specs`` are :class:`agent.models.backends.base.TensorSpec` (name, dtype, shape with int or
    symbolic dims). No dtype is cast implicitly: a silent float64 -> float32 would hide a client
    bug. The exceptions are the wire's own: booleans travel as uint8, so uint8 holding only
    0 and 1 is viewed as bool for a bool input; a string input (dtype object, ONNX's
    ``tensor(string)``) takes string tensors, which decode to object arrays of ``str`` (numpy's
    own ``str`` arrays, from local callers, are converted to that).
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
        if want.kind == "O" and _uncarried_type(spec):
            raise _bad(
                request_id,
                f"{_input(spec.name)} is {_uncarried_type(spec)}, which no request can carry",
            )
        if arr.dtype != want:
            if want == _BOOL and arr.dtype == _UINT8:
                if arr.size and int(arr.max()) > 1:
                    raise _bad(
                        request_id, f"{_input(spec.name)} is bool: its uint8 values must be 0 or 1"
                    )
                arr = arr.view(_BOOL)
            elif want == _STRING and arr.dtype.kind == "U":
                arr = arr.astype(_STRING)
            else:
                raise _bad(request_id, _dtype_problem(spec.name, arr.dtype, want))
        if arr.ndim != len(spec.shape):
            raise _bad(
                request_id,
                f"{_input(spec.name)} has rank {arr.ndim} (shape {format_dims(arr.shape)}), "
                f"expected rank {len(spec.shape)} ({spec.describe()})",
            )
        shape = arr.shape
        if shape and shape[0] == 0 and not isinstance(spec.shape[0], int):
            # No row to run: a request carries at least one (and ONNX Runtime aborts the
            # whole process on some models given none: an LSTM's, silero-vad's).
            raise _bad(
                request_id,
                f"{_input(spec.name)} has no rows (shape {format_dims(shape)}): a request "
                "carries at least one",
            )
        for axis, dim in _fixed_dims(spec.shape):
            if shape[axis] != dim:
                raise _bad(
                    request_id,
                    f"{_input(spec.name)} has {shape[axis]} at axis {axis} (shape "
                    f"{format_dims(shape)}), expected {dim} ({spec.describe()})",
                )
        checked[spec.name] = arr
    return checked
