"""One request's reply stream, as a subscriber sees it: messages put in `seq` order,
duplicates dropped (QoS 1 delivers at least once), `part` messages reassembled into one
chunk, gaps and a stream gone quiet asked for again on `ROOT/resend`, the terminal message
turned into `end`, `result` or a typed :class:`AgentError`.

No MQTT here: the connection (agent.client.connection) hands each decoded message in and
publishes the resend requests the stream asks for.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import cbor2
import numpy as np

from agent.protocol.errors import Limits
from agent.protocol.payload import decode_payload
from agent.protocol.values import decode_value

# Replies come from a trusted agent, but still through a broker: decode with generous limits.
REPLY_LIMITS = Limits(
    max_payload_bytes=256 * 1024 * 1024,
    max_decompressed_bytes=1024 * 1024 * 1024,
    max_depth=16,
    max_map_keys=4096,
    max_tensor_elements=1 << 31,
    max_tensor_bytes=1 << 33,
    max_rank=16,
    max_tensors=4096,
    max_items=1 << 26,  # a ZipMap's list of maps is several items per row
)
# Parts were each bounded on arrival; their joined bytes are bounded by the other limits.
_PARTS_LIMITS = replace(REPLY_LIMITS, max_payload_bytes=1 << 62, max_decompressed_bytes=1 << 62)

# A reply's outputs: name -> value. Numeric tensors are numpy arrays, string tensors numpy
# arrays of dtype object holding `str`; ONNX sequences are lists, maps dicts (tensors in
# them decoded to numpy too). Not only arrays, so typed `Any`; `Arrays` is its old name.
Outputs = dict[str, Any]
Arrays = Outputs


class AgentError(Exception):
    """The agent answered with an `error` message (`code` is one of the contract's codes)."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ReplyTimeout(AgentError, TimeoutError):
    """No message of the stream arrived within the timeout."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__("timeout", message, request_id)


@dataclass(frozen=True)
class Chunk:
    """One logical piece of the output (parts already reassembled)."""

    seq: int
    index: int
    outputs: Outputs  # name -> numpy array (string tensors: dtype object), list or dict
    model: str
    version: int
    ts: int  # agent's emit time, Unix ns (of the last part)
    received: float  # local time.perf_counter() when it was complete
    offset: int | None = None  # scan models: the first new sample of the chunk's first window
    # An image input's `geometry` ({source, input, scale, pad}), where the agent resized one.
    geometry: Mapping[str, Any] | None = None
    text: str | None = None  # a generate model with a tokenizer: the chunk's new text


@dataclass(frozen=True)
class StreamEnd:
    chunks: int
    timing: Mapping[str, float]
    model: str
    version: int
    finish_reason: str | None = None  # generate (and any cancelled request): why it ended
    usage: Mapping[str, int] | None = None  # generate: {prompt_tokens, completion_tokens}
    language: str | None = None  # a speech recogniser's: the language asked or detected


def decode_outputs(raw: Mapping[str, Any], limits: Limits = REPLY_LIMITS) -> Outputs:
    """A reply's decoded `outputs` map as the values the model gave (see :data:`Outputs`):
    tensors as numpy arrays, ONNX sequences as lists, maps as dicts."""
    return {str(k): decode_value(v, limits, name=str(k)) for k, v in raw.items()}


def _reassemble(parts: list[bytes], compression: Any = None) -> Outputs:
    """The outputs a chunk's `part` messages carry, joined in order and decoded."""
    joined = b"".join(parts)
    if compression is not None:  # the CBOR of one byte string: the compressed outputs
        return _unpacked(cbor2.loads(joined), compression)
    return decode_outputs(decode_payload(joined, _PARTS_LIMITS), _PARTS_LIMITS)


def _unpacked(outputs: Any, compression: Any) -> Outputs:
    """A chunk's `outputs`, undoing `params.reply_compression` where the chunk says so
    (the zstd frame goes through the payload guard: its size is checked before it is
    decompressed)."""
    if compression is None:
        return decode_outputs(outputs)
    if compression != "zstd" or not isinstance(outputs, bytes):
        raise AgentError("bad_reply", f"outputs compressed as {compression!r}: not known here")
    return decode_outputs(decode_payload(outputs, _PARTS_LIMITS), _PARTS_LIMITS)


def _join(values: list[Any]) -> Any:
    """One output's values from every chunk, as `collect` joins them: arrays concatenated on
    axis 0, lists chained; anything else (maps) kept as the list of the chunks' values."""
    if all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate(values, axis=0)
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    return values


@dataclass
class Reply:
    """The reply stream of one request: iterate it for chunks; `end` or `result` after."""

    request_id: str
    topic: str
    timeout: float
    _messages: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue, repr=False)
    _on_close: Callable[[Reply], None] | None = field(default=None, repr=False)
    # Gap recovery: `_ask(payload)` publishes a resend request (None: no recovery).
    _ask: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    model: str | None = None
    gap_wait_s: float = 0.3  # a missing seq this long, with later ones here: ask for it
    quiet_s: float = 1.5  # nothing this long before the terminal message: ask from next seq
    resend_requests: int = 0  # resend requests this stream sent
    recovered: int = 0  # messages that arrived after they were asked for again
    _asked: set[int] = field(default_factory=set, repr=False)
    _attempt: int = 0
    _last_message: float = field(default_factory=time.monotonic, repr=False)
    _last_ask: float = 0.0  # monotonic time of the last resend request (0: none yet)
    _gap_since: float | None = None
    end: StreamEnd | None = None
    result: Outputs | None = None
    timing: Mapping[str, float] | None = None
    geometry: Mapping[str, Any] | None = None  # a `result`'s image geometry
    text: str | None = None  # a generate `result`'s whole text
    finish_reason: str | None = None  # a generate `result`'s (the `end`'s: in `end`)
    usage: Mapping[str, int] | None = None
    language: str | None = None  # a speech recogniser's `result`: asked or detected
    version: int | None = None
    duplicates: int = 0
    messages: int = 0
    sent_at: float = 0.0
    _next_seq: int = 0
    _pending: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _parts: dict[int, list[dict[str, Any]]] = field(default_factory=dict, repr=False)
    _done: bool = False

    def _deliver(self, message: dict[str, Any]) -> None:
        self._messages.put(message)

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while not self._done:
                message = self._next_in_order()
                chunk = self._handle(message)
                if chunk is not None:
                    yield chunk
        finally:
            self.close()

    def _next_in_order(self) -> dict[str, Any]:
        """The message with the next `seq`, dropping duplicates and holding early arrivals.

        A gap (a missing seq while later ones arrived, parts that never complete) or a
        stream gone quiet before its terminal message is asked for again on `ROOT/resend`,
        with backoff, until `timeout` passes without any message.
        """
        while self._next_seq not in self._pending:
            now = time.monotonic()
            silent = now - self._last_message
            if silent >= self.timeout:
                raise ReplyTimeout(
                    f"no message for {self.timeout:.1f} s (next seq {self._next_seq}, "
                    f"{self.resend_requests} resend requests)",
                    self.request_id,
                )
            wait = self.timeout - silent
            due = self._recovery_due(now)
            if due is not None:
                wait = min(wait, max(0.0, due - now))
            try:
                message = self._messages.get(timeout=wait)
            except queue.Empty:
                if due is not None and time.monotonic() >= due:
                    self._ask_resend()
                continue
            self._last_message = time.monotonic()
            seq = message.get("seq")
            if message.get("type") == "gone":
                raise AgentError("gone", "the agent no longer holds this stream", self.request_id)
            if message.get("type") == "error" and seq is None:
                # Outside the numbering, and final: a request refused because its id is in
                # use, or one stored before a crash that failed when it ran again (its first
                # seqs came before the crash)
                code, text = str(message.get("code")), str(message.get("message"))
                raise AgentError(code, text, self.request_id)
            if not isinstance(seq, int) or seq < self._next_seq or seq in self._pending:
                self.duplicates += 1
                continue
            if seq in self._asked:
                self._asked.discard(seq)
                self.recovered += 1
            self._pending[seq] = message
            if self._next_seq not in self._pending and self._gap_since is None:
                self._gap_since = self._last_message
        self.messages += 1
        message = self._pending.pop(self._next_seq)
        self._next_seq += 1
        self._attempt = 0
        gap = bool(self._pending) and self._next_seq not in self._pending
        self._gap_since = time.monotonic() if gap else None
        return message

    def _backoff(self) -> float:
        return float(min(2**self._attempt, 16))

    def _recovery_due(self, now: float) -> float | None:
        """When to ask for a resend next, or None (no recovery, or nothing to ask yet)."""
        if self._ask is None:
            return None
        if self._pending and self._gap_since is not None:
            return self._gap_since + self.gap_wait_s * self._backoff()
        # A stream gone quiet (or that never started: its first messages may be what was
        # lost); the agent answers nothing while the request is still queued. Counted from the
        # last ask too: once the backoff stops growing, a time counted from the last message
        # alone stays in the past, and every pass would ask again at once.
        since = max(self._last_message, self._last_ask)
        return since + self.quiet_s * self._backoff()

    def _ask_resend(self) -> None:
        assert self._ask is not None
        body: dict[str, Any] = {"id": self.request_id}
        if self.model is not None:
            body["model"] = self.model
        if self._pending:
            missing = [
                s for s in range(self._next_seq, max(self._pending)) if s not in self._pending
            ]
            body["seqs"] = missing[:1000]
            self._asked.update(body["seqs"])
        else:
            body["from_seq"] = self._next_seq
            self._asked.add(self._next_seq)
        self._attempt += 1
        self.resend_requests += 1
        self._last_ask = time.monotonic()
        if self._pending:
            self._gap_since = time.monotonic()
        with contextlib.suppress(ConnectionError):  # not connected now: the next try will do
            self._ask(body)

    def _handle(self, message: dict[str, Any]) -> Chunk | None:
        kind = message.get("type")
        self.version = message.get("version", self.version)
        if kind == "chunk":
            return self._chunk(message)
        if kind == "end":
            self._done = True
            self.timing = message.get("timing", {})
            self.end = StreamEnd(
                int(message.get("chunks", 0)),
                self.timing,
                str(message.get("model")),
                int(message.get("version") or 0),
                message.get("finish_reason"),
                message.get("usage"),
                message.get("language"),
            )
            return None
        if kind == "result":
            self._done = True
            self.timing = message.get("timing", {})
            self.result = _unpacked(message.get("outputs", {}), message.get("compression"))
            self.geometry = message.get("geometry")
            self.text = message.get("text")
            self.finish_reason = message.get("finish_reason")
            self.usage = message.get("usage")
            self.language = message.get("language")
            return None
        if kind == "error":
            self._done = True
            raise AgentError(str(message.get("code")), str(message.get("message")), self.request_id)
        return None  # a newer message type this SDK does not know: skip it

    def _chunk(self, message: dict[str, Any]) -> Chunk | None:
        index = int(message["index"])
        part = message.get("part")
        compression = message.get("compression")
        if part is None:
            outputs = _unpacked(message["outputs"], compression)
        else:
            k, n = int(part[0]), int(part[1])
            parts = self._parts.setdefault(index, [])
            parts.append(message)
            if k != n - 1 or len(parts) != n:
                return None
            del self._parts[index]
            outputs = _reassemble([bytes(p["data"]) for p in parts], compression)
        return Chunk(
            seq=int(message["seq"]),
            index=index,
            outputs=outputs,
            model=str(message.get("model")),
            version=int(message.get("version") or 0),
            ts=int(message.get("ts") or 0),
            received=time.perf_counter(),
            offset=int(message["offset"]) if message.get("offset") is not None else None,
            geometry=message.get("geometry"),
            text=message.get("text"),
        )

    def collect(self) -> Outputs:
        """Wait for the whole stream; chunks of every output are concatenated on axis 0
        (arrays; lists are chained, maps come as the list of the chunks' maps).

        A `result` is returned as is.
        """
        chunks = list(self)
        if self.result is not None:
            return self.result
        if not chunks:
            return {}
        names = list(chunks[0].outputs)
        return {n: _join([c.outputs[n] for c in chunks]) for n in names}

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self)
