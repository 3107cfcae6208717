"""Requests that repeat a recent request's layout, parsed without decoding them again.

A backend sends a model the same request over and over with a new id and new tensor data: the
same keys, options, tensor names, dtypes and shapes, so the same bytes everywhere else. For
each model and payload size the network thread keeps the last request it decoded and checked
in full: its bytes, where its id and each tensor's data lie in them, and the fields it parsed
to. A payload of that size whose bytes equal those everywhere outside the id and the data is
that request with another id and other data, and is parsed as such: its id is checked against
the contract's pattern, its tensors are views of the payload (as decoding gives views of the
decoded byte strings), every other field is the learned request's. The checks against the
model's inputs (`Agent._precheck`) run on it as on any request.

Anything else (an unknown size, one byte that differs outside those spans, an id the pattern
refuses, other limits, reply topics or MQTT 5 response topic) goes the full way
(`decode_payload`, `parse_request`), and a request that passes it and its model's
checks becomes the layout for its size. So a payload parsed here is one the full way parses
to the same request: the bytes it shares with an accepted payload (and the response topic)
decide the structure, the limits and every option, and the bytes that differ are an id
(checked as the full way checks it) and tensor data of a fixed length (any bytes are values
of a numeric dtype; a bool input's 0/1 rule is checked by the precheck).

Why: decoding, parsing and checking a small request was the largest single cost of the
network thread, which reads every request (docs/decisions/0010-read-requests-by-
layout.md): 16 µs in a loop against 3.4 µs here, and about 40 µs of CPU a request under load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np

from agent.models.backends.base import Array
from agent.protocol.errors import ID_PATTERN, Limits
from agent.protocol.payload import ZSTD_MAGIC
from agent.protocol.requests import Request
from agent.protocol.tensors import cbor_text, typed_array_dtypes
from agent.protocol.topics import ReplyTopics

# Larger payloads are not learned: finding the spans costs a pass over the payload, and their
# decoding is dominated by the data, which the full way does not copy either.
MAX_PAYLOAD_BYTES = 64 * 1024
MAX_LAYOUTS = 128  # (model, size) pairs kept; once full, only those are matched
# Learning costs most of a full decoding. Where the layouts learned for a (model, size) in a
# row were never matched (a client whose requests differ in more than the id and the data,
# say a timestamp), learning is tried only every BACKOFF_EVERY-th time after BACKOFF_AFTER.
BACKOFF_AFTER = 4
BACKOFF_EVERY = 64


@dataclass(frozen=True)
class _Tensor:
    name: str
    start: int  # offset of the data in the payload
    count: int  # elements
    dtype: np.dtype[Any]  # as on the wire
    shape: tuple[int, ...]
    native: np.dtype[Any] | None  # the host's byte order, where the wire's differs


@dataclass(frozen=True)
class _Layout:
    fixed: tuple[tuple[int, bytes], ...]  # (offset, the bytes that must be there)
    id_start: int
    id_end: int
    tensors: tuple[_Tensor, ...]
    template: Request  # the parsed request, without inputs (never handed out)
    limits: Limits  # the limits and reply topics it was checked under
    reply_topics: ReplyTopics
    response_topic: str | None  # MQTT 5's, which the full way makes its reply_to if it has none


class RequestLayouts:
    """The network thread's: `parse` each request first, `learn` from the full way."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, int], _Layout] = {}
        self._unmatched: dict[tuple[str, int], int] = {}  # layouts learned in a row, no match
        self.hits = 0  # requests parsed here

    def __len__(self) -> int:
        return len(self._layouts)

    def parse(
        self,
        payload: bytes,
        model: str,
        limits: Limits,
        reply_topics: ReplyTopics,
        response_topic: str | None = None,
    ) -> Request | None:
        """The request, when `payload` (with this MQTT 5 response topic) repeats a layout of
        the model; else None."""
        key = (model, len(payload))
        layout = self._layouts.get(key)
        if (
            layout is None
            or type(payload) is not bytes
            or layout.limits is not limits
            or layout.response_topic != response_topic
            or layout.reply_topics != reply_topics
        ):
            return None
        for offset, expected in layout.fixed:
            if not payload.startswith(expected, offset):
                return None
        try:
            request_id = payload[layout.id_start : layout.id_end].decode("ascii")
        except UnicodeDecodeError:
            return None
        if not ID_PATTERN.match(request_id):
            return None
        inputs: dict[str, Array] = {}
        for tensor in layout.tensors:
            arr: Array = np.frombuffer(payload, tensor.dtype, tensor.count, tensor.start)
            arr = arr.reshape(tensor.shape)
            if tensor.native is not None:
                arr = arr.astype(tensor.native)
            inputs[tensor.name] = arr
        template = layout.template
        self.hits += 1
        if self._unmatched:
            self._unmatched.pop(key, None)
        # Every field of the template (dataclasses.replace would cost 2 µs more a request).
        return Request(
            id=request_id,
            model=model,
            inputs=inputs,
            version=template.version,
            stream=template.stream,
            priority=template.priority,
            deadline_ms=template.deadline_ms,
            qos=template.qos,
            reply_to=template.reply_to,
            params=dict(template.params),
        )

    def learn(
        self,
        payload: bytes,
        decoded: Mapping[str, Any],
        request: Request,
        limits: Limits,
        reply_topics: ReplyTopics,
        response_topic: str | None = None,
    ) -> None:
        """Keep the layout of a request that passed the full way: `decoded` is what
        `decode_payload` gave for `payload` (with the response topic merged as the full
        way merges it), `request` what `parse_request` made of that. Nothing is kept
        where its id or a tensor's data is not in the payload exactly once (then no span can
        be trusted)."""
        key = (request.model, len(payload))
        if (
            type(payload) is not bytes
            or len(payload) > MAX_PAYLOAD_BYTES
            or payload[:4] == ZSTD_MAGIC
            or (key not in self._layouts and len(self._layouts) >= MAX_LAYOUTS)
        ):
            return
        unmatched = self._unmatched.get(key, 0)
        if len(self._unmatched) >= 4 * MAX_LAYOUTS and not unmatched:
            self._unmatched.clear()  # keys of sizes that came once: start over
        self._unmatched[key] = unmatched + 1
        if unmatched >= BACKOFF_AFTER and unmatched % BACKOFF_EVERY:
            return
        layout = _find_layout(payload, decoded, request, limits, reply_topics, response_topic)
        if layout is None:
            self._layouts.pop(key, None)
        else:
            self._layouts[key] = layout


def _find_layout(
    payload: bytes,
    decoded: Mapping[str, Any],
    request: Request,
    limits: Limits,
    reply_topics: ReplyTopics,
    response_topic: str | None,
) -> _Layout | None:
    encoded_id = cbor_text(request.id)
    id_at = _once(payload, encoded_id)
    raw_inputs = decoded.get("inputs")
    if id_at is None or not isinstance(raw_inputs, Mapping):
        return None
    id_end = id_at + len(encoded_id)
    id_start = id_end - len(request.id)  # after the text's head (the id is ASCII)
    spans = [(id_start, id_end)]
    tensors = []
    for name, arr in request.inputs.items():
        typed = _typed_array(raw_inputs.get(name))
        if typed is None or not typed.value:
            return None
        raw: bytes = typed.value
        # Looked for with its tag and head, which zeros after a length byte cannot fake.
        encoded = cbor2.dumps(typed)
        at = _once(payload, encoded)
        if at is None:
            return None
        start = at + len(encoded) - len(raw)
        dtypes = typed_array_dtypes(typed.tag)
        if dtypes is None:
            return None
        dtype, native = dtypes
        tensors.append(_Tensor(name, start, len(raw) // dtype.itemsize, dtype, arr.shape, native))
        spans.append((start, start + len(raw)))
    fixed = []
    position = 0
    for start, end in sorted(spans):
        if start < position:
            return None  # overlapping spans
        if start > position:
            fixed.append((position, payload[position:start]))
        position = end
    if position < len(payload):
        fixed.append((position, payload[position:]))
    template = dataclasses.replace(
        request, inputs={}, params=dict(request.params), correlation_data=None
    )
    return _Layout(
        tuple(fixed),
        id_start,
        id_end,
        tuple(tensors),
        template,
        limits,
        reply_topics,
        response_topic,
    )


def _once(payload: bytes, part: bytes) -> int | None:
    """Where `part` is in `payload`, if it is there exactly once."""
    at = payload.find(part)
    if at < 0 or payload.find(part, at + 1) >= 0:
        return None
    return at


def _typed_array(obj: Any) -> cbor2.CBORTag | None:
    """The typed array (a tag 64-87 over a byte string) of a decoded tensor, or None."""
    if isinstance(obj, cbor2.CBORTag) and obj.tag == 40:
        value = obj.value
        obj = value[1] if isinstance(value, (list, tuple)) and len(value) == 2 else None
    if isinstance(obj, cbor2.CBORTag) and 64 <= obj.tag <= 87 and type(obj.value) is bytes:
        return obj
    return None
