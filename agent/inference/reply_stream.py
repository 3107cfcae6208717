"""The reply messages of one request: numbering, byte parts, exactly one terminal message.

A :class:`ReplyStream` turns outputs into messages (`chunk`, `result`, `end`, `error`) and
keeps them until its driver takes them with :meth:`ReplyStream.drain`: it never touches the
outbox itself, so every message leaves through one door, a :class:`ReplySender` (a run's
messages after each run of the model, waiting for room; an error at ingress at once, from
the outbox's reserve). A chunk larger than `max_chunk_bytes` becomes `part` messages.

One request's replies are bounded too (`max_reply_bytes`, the `[limits]` key): the payload
bytes of its `chunk` and `result` messages are counted as they are made (one add a message),
and a chunk or result that would pass the bound is not made: :class:`ReplyTooLarge` is raised
instead, and the driver ends the stream with an `error` (`too_large`) after what was made.

Chunk and result payloads are assembled around the outputs' encoded bytes (the tensor data
is copied once, into the payload); the bytes are those `encode_with_outputs` would make.

An output with no wire form (a complex or bfloat16 array, a set, any object that is not an
ONNX value) fails its request, not the model: the chunk or result is not made and
:class:`OutputNotEncodable` (`model_error`, naming the output and its type) is raised
instead, for the driver to end the stream with an `error`, like :class:`ReplyTooLarge`
(both are a :class:`ReplyRefused`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

from agent.delivery.outbox import Outbox, OutMessage
from agent.ops.counters import Counters
from agent.ops.metrics import AgentMetrics
from agent.protocol.errors import PROTOCOL_VERSION, WireError
from agent.protocol.payload import encode_payload, zstd_frame
from agent.protocol.replies import reply_envelope, split_parts
from agent.protocol.tensors import cbor_text, cbor_uint, outputs_pieces
from agent.protocol.values import value_nbytes

log = logging.getLogger(__name__)

# Room for the envelope around a part's `data` and for the MQTT header and topic.
PART_OVERHEAD = 512
_CHUNK_KEYS = 9  # v, id, seq, type, model, version, ts, index, outputs
_INDEX_KEY = cbor_text("index")
_OFFSET_KEY = cbor_text("offset")
_OUTPUTS_KEY = cbor_text("outputs")
_SEQ_KEY = cbor_text("seq")
_TIMING_KEY = cbor_text("timing")
_RESULT_KEYS = 9  # v, id, seq, type, model, version, ts, timing, outputs
# A reply envelope's bytes after its map head, up to the id's value.
_V_AND_ID_KEY = b"".join(cbor2.dumps(x) for x in ("v", PROTOCOL_VERSION, "id"))
_RESULT_HEAD = bytes((0xA0 + _RESULT_KEYS,)) + _V_AND_ID_KEY


class ReplyRefused(WireError):
    """A chunk or result of one request that was not made (nothing of it was): that request
    ends with an `error` carrying this code and message; the run and its model go on."""


class ReplyTooLarge(ReplyRefused):
    """The next chunk or result would pass the request's reply budget (nothing was made)."""

    def __init__(self, budget: int, made: int) -> None:
        super().__init__(
            "too_large",
            f"reply budget exceeded: the outputs would pass limits.max_reply_bytes "
            f"({budget} bytes) after {made} bytes of replies",
        )


class OutputNotEncodable(ReplyRefused):
    """An output of the chunk or result has no wire form (nothing was made): `model_error`,
    the message naming the output and its type (see `agent.protocol.values`)."""

    def __init__(self, problem: Exception) -> None:
        super().__init__("model_error", str(problem))


def _encoded(outputs: Mapping[str, Any]) -> tuple[list[Any], int]:
    """`outputs_pieces`, its encoding failures (TypeError, ValueError) as OutputNotEncodable."""
    try:
        return outputs_pieces(outputs)
    except (TypeError, ValueError) as e:
        raise OutputNotEncodable(e) from e


def _cbor_pairs(fields: Mapping[str, Any]) -> bytes:
    """A map's key/value pairs as CBOR, without the map's head (the keys' bytes cached)."""
    return b"".join(cbor_text(k) + cbor2.dumps(v) for k, v in fields.items())


@functools.lru_cache(maxsize=256)
def _envelope_middle(type_: str, model: str, version: int) -> bytes:
    """A reply envelope's bytes from "type" to the "ts" key: the same for every message of
    that type from one model version."""
    return b"".join(
        cbor2.dumps(x) for x in ("type", type_, "model", model, "version", version, "ts")
    )


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
    properties: Any = None  # MQTT 5 properties (correlation data) carried on every message
    correlation: bytes | None = None  # the raw correlation data, kept with spooled messages
    stream_key: str | None = None  # spool stream of QoS 1/2 messages ("model/id")
    request_key: str | None = None  # the stored request the terminal message finishes
    # A stored request run again after a crash: its first seqs may have reached subscribers
    # before it, so an `error` ending it has `seq` null (a seq they hold would be dropped)
    replayed: bool = False
    # Payload bytes this request's chunk and result messages may take (requests: the
    # `[limits]` key; the default, no bound, is for the endless streams of local sources).
    max_reply_bytes: int = sys.maxsize
    reply_bytes: int = 0  # payload bytes of the chunk and result messages made so far
    held_bytes: int = 0  # output bytes held for a `stream: false` result (see `hold`)
    seq: int = 0
    chunks: int = 0
    finished: bool = False
    # Messages made and not yet taken by the driver (`drain`), in order.
    out: list[OutMessage] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The constant bytes of this stream's chunk messages, for the version they were made for.
    _prefix: tuple[int, bytes, bytes] | None = field(default=None, repr=False)
    # More keys of every chunk and result (a preprocessed image's `geometry`), and
    # `compression = "zstd"` (`params.reply_compression`): each chunk's encoded outputs
    # travel as one zstd byte string, flagged by the key `compression` (docs/protocol.md).
    extra: dict[str, Any] | None = None
    compression: str | None = None

    def _extra_fields(self) -> dict[str, Any]:
        fields = dict(self.extra) if self.extra else {}
        if self.compression is not None:
            fields["compression"] = self.compression
        return fields

    def _extra_cbor(self) -> tuple[int, bytes]:
        """The extra keys as CBOR pairs, and how many there are."""
        if not self.extra and self.compression is None:  # most streams: no dict made
            return 0, b""
        fields = self._extra_fields()
        return len(fields), _cbor_pairs(fields)

    def _outputs(self, outputs: Mapping[str, Any]) -> tuple[list[Any], int]:
        """The outputs' CBOR pieces (compressed into one byte string where asked)."""
        pieces, size = _encoded(outputs)
        if self.compression is None:
            return pieces, size
        packed = zstd_frame(b"".join(pieces))
        pieces = [cbor2.dumps(packed)]
        return pieces, len(pieces[0])

    def _fields(self, type_: str, **extra: Any) -> dict[str, Any]:
        fields = reply_envelope(
            request_id=self.request_id,
            seq=self.seq,
            type=type_,
            model=self.model,
            version=self.version,
            **extra,
        )
        self.seq += 1
        return fields

    def drain(self) -> list[OutMessage]:
        """The messages made since the last call, in order (the driver sends them)."""
        messages = self.out
        if messages:
            self.out = []
        return messages

    def _emit(self, payload: bytes, *, terminal: bool = False) -> None:
        self.out.append(
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

    def chunk(
        self,
        outputs: Mapping[str, Any],
        index: int,
        offset: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """One `chunk` (or its parts); ReplyTooLarge, with nothing made, past the budget;
        OutputNotEncodable, with nothing made, for an output with no wire form. `offset`
        (a scan's first new sample) is one more key after `index`; None: no key. `extra`:
        more keys of this chunk alone (a generation's `text`), after `offset` and before
        the stream's own (`self.extra`, `compression`). Nothing once the stream ended (a
        run that returns after the agent answered its request `shutting_down`)."""
        if self.finished:
            return
        pieces, size = self._outputs(outputs)
        if size + PART_OVERHEAD <= self.max_chunk_bytes:
            payload = self._chunk_payload(pieces, index, offset, extra)
            total = self.reply_bytes + len(payload)
            if total > self.max_reply_bytes:
                self.seq -= 1  # never sent: its number goes to the error
                raise ReplyTooLarge(self.max_reply_bytes, self.reply_bytes)
            self.reply_bytes = total
            self._emit(payload)
            self.chunks += 1
            return
        self._parts(b"".join(pieces), index, offset, extra)

    def hold(self, outputs: Mapping[str, Any]) -> None:
        """Count outputs kept for a `stream: false` result against the budget, so a result
        that cannot be sent is refused before all of it was computed (ReplyTooLarge). Lists
        and dicts (ONNX sequences and maps) are counted by an estimate of their size."""
        self.held_bytes += sum(value_nbytes(a) for a in outputs.values())
        if self.reply_bytes + self.held_bytes > self.max_reply_bytes:
            raise ReplyTooLarge(self.max_reply_bytes, self.reply_bytes)

    def _chunk_payload(
        self,
        outputs: list[Any],
        index: int,
        offset: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> bytes:
        """`{v, id, seq, type: "chunk", model, version, ts, index, outputs}` (with `offset`
        after `index` where given, then the chunk's `extra` keys, then the stream's), the
        same bytes as `encode_with_outputs` would make, in
        one join around the outputs' pieces (the tensor data is copied once, into the
        payload)."""
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
        head = prefix[1]
        more: tuple[bytes, ...] = ()
        count, pairs = self._extra_cbor()
        if offset is not None:  # one more key
            count += 1
            more = (_OFFSET_KEY, cbor_uint(offset))
        if extra:  # the chunk's own keys
            count += len(extra)
            more = (*more, _cbor_pairs(extra))
        if pairs:
            more = (*more, pairs)
        if count:  # more keys: the map's head counts them
            head = bytes((head[0] + count,)) + head[1:]
        return b"".join(
            (
                head,
                cbor_uint(seq),
                prefix[2],
                cbor_uint(time.time_ns()),
                _INDEX_KEY,
                cbor_uint(index),
                *more,
                _OUTPUTS_KEY,
                *outputs,
            )
        )

    def _parts(
        self,
        outputs_cbor: bytes,
        index: int,
        offset: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """A chunk too large for one message: `part: [k, n]` messages carrying its bytes,
        all of them or (past the budget: ReplyTooLarge) none."""
        room = self.max_chunk_bytes - PART_OVERHEAD
        count = -(-len(outputs_cbor) // room)
        if self.reply_bytes + len(outputs_cbor) + count * PART_OVERHEAD > self.max_reply_bytes:
            raise ReplyTooLarge(self.max_reply_bytes, self.reply_bytes)
        pieces = split_parts(outputs_cbor, room)
        where = {"index": index} if offset is None else {"index": index, "offset": offset}
        if extra:
            where.update(extra)
        where.update(self._extra_fields())
        for k, data in enumerate(pieces):
            fields = self._fields("chunk", **where, part=[k, len(pieces)], data=data)
            payload = encode_payload(fields)
            self.reply_bytes += len(payload)
            self._emit(payload)
            self.chunks += 1

    def _terminal(self, payload_fields: dict[str, Any]) -> bool:
        with self._lock:
            if self.finished:
                return False
            self.finished = True
        self._emit(encode_payload(payload_fields), terminal=True)
        return True

    def end(self, timing: Mapping[str, float], **more: Any) -> bool:
        """The `end`; `more`: its further keys (a generation's `finish_reason`, `usage`)."""
        return self._terminal(self._fields("end", chunks=self.chunks, timing=dict(timing), **more))

    def result(self, outputs: Mapping[str, Any], timing: Mapping[str, float]) -> bool:
        """The `result` (or parts and `end`); ReplyTooLarge, with nothing made, past the
        budget; OutputNotEncodable, with nothing made, for an output with no wire form."""
        pieces, size = self._outputs(outputs)
        if size + PART_OVERHEAD > self.max_chunk_bytes:
            # One message cannot hold it: stream the parts, then close with `end`.
            self._parts(b"".join(pieces), 0)
            return self.end(timing)
        with self._lock:
            if self.finished:
                return False
            if self.reply_bytes + size + PART_OVERHEAD > self.max_reply_bytes:
                raise ReplyTooLarge(self.max_reply_bytes, self.reply_bytes)
            self.finished = True
        self._emit(self._result_payload(pieces, timing), terminal=True)
        return True

    def _result_payload(self, outputs: list[Any], timing: Mapping[str, float]) -> bytes:
        """`{v, id, seq, type: "result", model, version, ts, timing, outputs}`, the same bytes
        as `encode_with_outputs` would make, in one join (as `_chunk_payload`): the constant
        part after the id is kept per model version, shared by every request's result."""
        seq = self.seq
        self.seq = seq + 1
        count, pairs = self._extra_cbor()
        head = _RESULT_HEAD if not count else bytes((_RESULT_HEAD[0] + count,)) + _RESULT_HEAD[1:]
        payload = b"".join(
            (
                head,
                cbor2.dumps(self.request_id),
                _SEQ_KEY,
                cbor_uint(seq),
                _envelope_middle("result", self.model, self.version),
                cbor_uint(time.time_ns()),
                _TIMING_KEY,
                cbor2.dumps(dict(timing)),
                pairs,
                _OUTPUTS_KEY,
                *outputs,
            )
        )
        self.reply_bytes += len(payload)
        return payload

    def error(self, code: str, message: str) -> bool:
        fields = self._fields("error", code=code, message=message[:500])
        if self.replayed:  # numbered still (`_emit`: its spool seq), shown without
            fields["seq"] = None
        return self._terminal(fields)

    def unsequenced_error(self, code: str, message: str) -> OutMessage:
        """An `error` with `seq` null, outside this stream's numbering (and its spool stream):
        the answer to a request refused because its id names another, running stream, whose
        messages it must not be mistaken for."""
        fields = reply_envelope(
            request_id=self.request_id,
            seq=None,
            type="error",
            model=self.model,
            version=self.version,
            code=code,
            message=message[:500],
        )
        return OutMessage(self.topic, encode_payload(fields), self.qos, False, self.properties)


class ReplySender:
    """The one way replies reach the outbox, and are counted on the way.

    `send`: a run's messages, together (one round of the outbox's lock, one socket write),
    waiting for room: a worker's way. `send_now`: never waits, from the outbox's reserve:
    the network thread's way (errors at ingress), which must never block; a message with no
    room even there is dropped, counted and logged.
    """

    def __init__(self, outbox: Outbox, metrics: AgentMetrics, counters: Counters) -> None:
        self._outbox = outbox
        self._metrics = metrics
        self._counters = counters
        self._thread = threading.local()  # `.holds_connection`: see `holding_connection`

    @contextlib.contextmanager
    def holding_connection(self) -> Iterator[None]:
        """Within it, this thread's `send` never waits for room (`Outbox.put_many_now`): it
        holds the connection, and room comes only from its publishing and reading."""
        self._thread.holds_connection = True
        try:
            yield
        finally:
            self._thread.holds_connection = False

    def send(self, messages: Sequence[OutMessage], *, kick: bool = True) -> None:
        """Raises OutboxClosed once the outbox closed (the agent is stopping). `kick=False`:
        queued, published by the next `kick()` (or anyone's publishing round before it)."""
        if not messages:
            return
        if getattr(self._thread, "holds_connection", False):
            self._outbox.put_many_now(messages)
        else:
            self._outbox.put_many(messages)
        self._metrics.reply_sent(sum(len(m.payload) for m in messages), len(messages))
        if kick:
            self._outbox.kick()

    def kick(self) -> None:
        """Publish what `send(..., kick=False)` queued."""
        self._outbox.kick()

    def drive(self) -> None:
        """`kick` from a stream that goes on: the broker's answers are read on this thread
        too (`Outbox.kick(read=True)`, docs/decisions/0034)."""
        self._outbox.kick(read=True)

    def hand_off(self) -> None:
        """Have the io thread publish what `send(..., kick=False)` queued."""
        self._outbox.hand_off()

    def has_room(self, messages: int, size: int) -> bool:
        """Whether `messages` of up to `size` bytes each would be queued without waiting."""
        return self._outbox.has_room(messages, size)

    def send_now(self, messages: Sequence[OutMessage]) -> None:
        for message in messages:
            if not self._outbox.put_nowait_reserved(message):
                self._counters.add("replies_dropped_outbox_full")
                log.error(
                    "outbox full: an error reply to %s could not be queued", message.topic[:200]
                )
                continue
            self._metrics.reply_sent(len(message.payload))
