"""How one request's output becomes a stream of messages: the three modes and byte parts.

* `whole`: one run, one chunk (or one `result`).
* `batch`: the leading axis `micro_batch` items at a time, one chunk per slice (`index` = the
  first item of the slice).
* `steps`: the model is one decode step; outputs are fed back as inputs (`feed`, `state`) and
  each step's `emit` outputs go out as one chunk the moment the step finishes.

Each chunk is handed to the :class:`ReplyStream`, which numbers it, splits it into `part`
messages when it would exceed `max_chunk_bytes`, and queues it for the publisher: inference
never waits on the network.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import cbor2
import numpy as np

from agent.delivery.outbox import OutMessage
from agent.models.backends.base import Array, InferenceError, Session
from agent.models.repository import StreamConfig
from agent.protocol import wire

Arrays = dict[str, Array]

# Room for the envelope around a part's `data` and for the MQTT header and topic.
PART_OVERHEAD = 512
_CHUNK_KEYS = 9  # v, id, seq, type, model, version, ts, index, outputs
_INDEX_KEY = wire.cbor_text("index")
_OUTPUTS_KEY = wire.cbor_text("outputs")
_SEQ_KEY = wire.cbor_text("seq")
_TIMING_KEY = wire.cbor_text("timing")
_RESULT_KEYS = 9  # v, id, seq, type, model, version, ts, timing, outputs
# A reply envelope's bytes after its map head, up to the id's value.
_V_AND_ID_KEY = b"".join(cbor2.dumps(x) for x in ("v", wire.PROTOCOL_VERSION, "id"))
_RESULT_HEAD = bytes((0xA0 + _RESULT_KEYS,)) + _V_AND_ID_KEY


@functools.lru_cache(maxsize=256)
def _envelope_middle(type_: str, model: str, version: int) -> bytes:
    """A reply envelope's bytes from "type" to the "ts" key: the same for every message of
    that type from one model version."""
    return b"".join(
        cbor2.dumps(x) for x in ("type", type_, "model", model, "version", version, "ts")
    )


class Cancelled(Exception):
    """The agent is stopping and this request could not finish in time."""


class CancelFlag:
    """Set once, when the agent stops, to end a request between pieces. Only ever polled,
    never waited on: a plain flag, not a `threading.Event` (one per request)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def encode_with_outputs(fields: Mapping[str, Any], outputs_cbor: bytes) -> bytes:
    """CBOR of `{**fields, "outputs": <outputs_cbor>}` without decoding or re-encoding outputs.

    The outputs are encoded once (their size decides whether parts are needed), so the
    envelope is assembled around those bytes instead of encoding the tensors a second time:
    the fields are encoded as one map and its head is given one more entry.
    """
    count = len(fields)
    if count >= 23:  # the head would change size: the rare slow way
        head = bytes([0xB8, count + 1])
        body = b"".join(cbor2.dumps(k) + cbor2.dumps(v) for k, v in fields.items())
        return b"".join((head, body, _OUTPUTS_KEY, outputs_cbor))
    encoded = memoryview(cbor2.dumps(dict(fields)))
    return b"".join((bytes((0xA0 + count + 1,)), encoded[1:], _OUTPUTS_KEY, outputs_cbor))


@dataclass
class ReplyStream:
    """The reply messages of one request: numbering, parts, exactly one terminal message."""

    request_id: str
    model: str
    version: int
    topic: str
    qos: int
    max_chunk_bytes: int
    send: Callable[[OutMessage], None]
    properties: Any = None  # MQTT 5 properties (correlation data) carried on every message
    correlation: bytes | None = None  # the raw correlation data, kept with spooled messages
    stream_key: str | None = None  # spool stream of QoS 1/2 messages ("model/id")
    request_key: str | None = None  # the stored request the terminal message finishes
    seq: int = 0
    chunks: int = 0
    finished: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The constant bytes of this stream's chunk messages, for the version they were made for.
    _prefix: tuple[int, bytes, bytes] | None = field(default=None, repr=False)

    def _fields(self, type_: str, **extra: Any) -> dict[str, Any]:
        fields = wire.reply_envelope(
            request_id=self.request_id,
            seq=self.seq,
            type=type_,
            model=self.model,
            version=self.version,
            **extra,
        )
        self.seq += 1
        return fields

    def _emit(self, payload: bytes, *, terminal: bool = False) -> None:
        self.send(
            OutMessage(
                self.topic,
                payload,
                self.qos,
                False,
                self.properties,
                stream=self.stream_key,
                finishes=self.request_key if terminal else None,
                correlation=self.correlation,
                rid=self.request_id,
                seq=self.seq - 1,  # _fields numbered this message already
            )
        )

    def chunk(self, outputs: Mapping[str, Array], index: int) -> None:
        pieces, size = wire.outputs_pieces(outputs)
        if size + PART_OVERHEAD <= self.max_chunk_bytes:
            self._emit(self._chunk_payload(pieces, index))
            self.chunks += 1
            return
        self._parts(b"".join(pieces), index)

    def _chunk_payload(self, outputs: list[Any], index: int) -> bytes:
        """`{v, id, seq, type: "chunk", model, version, ts, index, outputs}`, the same bytes
        as `encode_with_outputs` would make, in one join around the outputs' pieces (the
        tensor data is copied once, into the payload)."""
        prefix = self._prefix
        if prefix is None or prefix[0] != self.version:
            head = b"".join(
                (
                    bytes((0xA0 + _CHUNK_KEYS,)),
                    _V_AND_ID_KEY,
                    cbor2.dumps(self.request_id),
                    _SEQ_KEY,
                )
            )
            middle = _envelope_middle("chunk", self.model, self.version)
            prefix = self._prefix = (self.version, head, middle)
        seq = self.seq
        self.seq = seq + 1
        return b"".join(
            (
                prefix[1],
                wire.cbor_uint(seq),
                prefix[2],
                wire.cbor_uint(time.time_ns()),
                _INDEX_KEY,
                wire.cbor_uint(index),
                _OUTPUTS_KEY,
                *outputs,
            )
        )

    def _parts(self, outputs_cbor: bytes, index: int) -> None:
        """A chunk too large for one message: `part: [k, n]` messages carrying its bytes."""
        pieces = wire.split_parts(outputs_cbor, self.max_chunk_bytes - PART_OVERHEAD)
        for k, data in enumerate(pieces):
            fields = self._fields("chunk", index=index, part=[k, len(pieces)], data=data)
            self._emit(wire.encode_payload(fields))
            self.chunks += 1

    def _terminal(self, payload_fields: dict[str, Any]) -> bool:
        with self._lock:
            if self.finished:
                return False
            self.finished = True
        self._emit(wire.encode_payload(payload_fields), terminal=True)
        return True

    def end(self, timing: Mapping[str, float]) -> bool:
        return self._terminal(self._fields("end", chunks=self.chunks, timing=dict(timing)))

    def result(self, outputs: Mapping[str, Array], timing: Mapping[str, float]) -> bool:
        pieces, size = wire.outputs_pieces(outputs)
        if size + PART_OVERHEAD > self.max_chunk_bytes:
            # One message cannot hold it: stream the parts, then close with `end`.
            self._parts(b"".join(pieces), 0)
            return self.end(timing)
        with self._lock:
            if self.finished:
                return False
            self.finished = True
        self._emit(self._result_payload(pieces, timing), terminal=True)
        return True

    def _result_payload(self, outputs: list[Any], timing: Mapping[str, float]) -> bytes:
        """`{v, id, seq, type: "result", model, version, ts, timing, outputs}`, the same bytes
        as `encode_with_outputs` would make, in one join (as `_chunk_payload`): the constant
        part after the id is kept per model version, shared by every request's result."""
        seq = self.seq
        self.seq = seq + 1
        return b"".join(
            (
                _RESULT_HEAD,
                cbor2.dumps(self.request_id),
                _SEQ_KEY,
                wire.cbor_uint(seq),
                _envelope_middle("result", self.model, self.version),
                wire.cbor_uint(time.time_ns()),
                _TIMING_KEY,
                cbor2.dumps(dict(timing)),
                _OUTPUTS_KEY,
                *outputs,
            )
        )

    def error(self, code: str, message: str) -> bool:
        return self._terminal(self._fields("error", code=code, message=message[:500]))


@dataclass
class RunStats:
    infer_s: float = 0.0
    runs: int = 0


@dataclass
class Execution:
    """One request run against one leased session. `cancelled` is checked between pieces."""

    session: Session
    stream_config: StreamConfig
    inputs: Arrays
    params: Mapping[str, Any]
    cancelled: CancelFlag
    stats: RunStats = field(default_factory=RunStats)

    def _run(self, inputs: Mapping[str, Array]) -> Arrays:
        if self.cancelled.is_set():
            raise Cancelled
        started = time.perf_counter()
        outputs = self.session.run(inputs)
        self.stats.infer_s += time.perf_counter() - started
        self.stats.runs += 1
        return outputs

    def pieces(self) -> Iterator[tuple[int, Arrays]]:
        """Yield `(index, outputs)` for each chunk, as soon as each exists."""
        mode = self.stream_config.mode
        if mode == "whole":
            yield 0, self._run(self.inputs)
        elif mode == "batch":
            yield from self._batch()
        else:
            yield from self._steps()

    def _batch(self) -> Iterator[tuple[int, Arrays]]:
        sizes = {v.shape[0] if v.ndim else None for v in self.inputs.values()}
        if len(sizes) != 1 or None in sizes:
            raise wire.WireError(
                "bad_request", "batch mode needs every input to share the same leading axis"
            )
        total = int(next(iter(sizes)) or 0)
        step = self.stream_config.micro_batch
        for start in range(0, total, step):
            part = {k: v[start : start + step] for k, v in self.inputs.items()}
            yield start, self._run(part)

    def _steps(self) -> Iterator[tuple[int, Arrays]]:
        config = self.stream_config
        state_outputs = set(config.state.values())
        emit = config.emit if config.emit is not None else None
        inputs = dict(self.inputs)
        for step in range(max_steps(config, self.params)):
            outputs = self._run(inputs)
            names = emit if emit is not None else [n for n in outputs if n not in state_outputs]
            yield step, {n: outputs[n] for n in names}
            if config.stop is not None and _all_equal(
                outputs[config.stop.output], config.stop.value
            ):
                return
            for target, source in (*config.feed.items(), *config.state.items()):
                value = outputs[source]
                expected = inputs[target]
                if value.dtype != expected.dtype or value.shape != expected.shape:
                    raise InferenceError(
                        f"cannot feed output '{source}' {value.dtype}{list(value.shape)} "
                        f"into input '{target}' {expected.dtype}{list(expected.shape)}"
                    )
                inputs[target] = value


def max_steps(config: StreamConfig, params: Mapping[str, Any]) -> int:
    """Steps a request may run: `params.max_steps` (checked), else the model's bound."""
    limit = config.max_steps
    asked = params.get("max_steps")
    if asked is None:
        return limit
    if isinstance(asked, bool) or not isinstance(asked, int) or not 1 <= asked <= limit:
        raise wire.WireError(
            "bad_request", f"params.max_steps must be an integer from 1 to {limit}"
        )
    return asked


def _all_equal(array: Array, value: float) -> bool:
    return bool(np.all(array == value))


def initial_state(session: Session, config: StreamConfig, inputs: Arrays) -> Arrays:
    """Zero-filled state inputs the request did not give (symbolic dims: the batch size)."""
    if config.mode != "steps":
        return inputs
    given = [v for v in inputs.values() if v.ndim]
    batch = int(given[0].shape[0]) if given else 1
    full = dict(inputs)
    for spec in session.inputs:
        if spec.name in config.state and spec.name not in full:
            shape = tuple(d if isinstance(d, int) else batch for d in spec.shape)
            full[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return full


def merge_pieces(mode: str, pieces: list[tuple[int, Arrays]]) -> Arrays:
    """The whole output for `stream: false`.

    `batch` slices are concatenated back along the leading axis; `steps` outputs are stacked
    on a new leading axis (one entry per step), so `result` carries exactly what the chunks
    would have carried.
    """
    if not pieces:
        return {}
    if mode == "whole":
        return pieces[0][1]
    names = list(pieces[0][1])
    join = np.concatenate if mode == "batch" else np.stack
    return {n: join([p[1][n] for p in pieces], axis=0) for n in names}
