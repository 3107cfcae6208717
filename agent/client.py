"""The subscriber SDK: send a request to an agent and iterate its reply stream.

    with AgentClient("127.0.0.1", 1883, device_id="jetson-01") as client:
        for chunk in client.request("decoder", {"token": tokens}):
            print(chunk.index, chunk.outputs["next_token"])

The SDK does what every subscriber has to do, once: it subscribes to the reply topic before
publishing the request, decodes CBOR and RFC 8746 tensors, reassembles `part` messages, drops
duplicates by `seq` (QoS 1 delivers at least once), yields chunks in `seq` order, raises a
typed :class:`AgentError` for an `error` message and :class:`ReplyTimeout` when the stream
goes quiet.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.models.backends.base import Array
from agent.protocol import wire

__all__ = ["AgentClient", "AgentError", "Chunk", "Reply", "ReplyTimeout", "StreamEnd"]

# Replies come from a trusted agent, but still through a broker: decode with generous limits.
REPLY_LIMITS = wire.Limits(
    max_payload_bytes=256 * 1024 * 1024,
    max_decompressed_bytes=1024 * 1024 * 1024,
    max_depth=16,
    max_map_keys=4096,
    max_tensor_elements=1 << 31,
    max_tensor_bytes=1 << 33,
    max_rank=16,
    max_tensors=4096,
)

Arrays = dict[str, Array]


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
    outputs: Arrays
    model: str
    version: int
    ts: int  # agent's emit time, Unix ns (of the last part)
    received: float  # local time.perf_counter() when it was complete


@dataclass(frozen=True)
class StreamEnd:
    chunks: int
    timing: Mapping[str, float]
    model: str
    version: int


def decode_outputs(raw: Mapping[str, Any]) -> Arrays:
    return {str(k): wire.decode_tensor(v, REPLY_LIMITS, name=str(k)) for k, v in raw.items()}


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
    result: Arrays | None = None
    timing: Mapping[str, float] | None = None
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
            )
            return None
        if kind == "result":
            self._done = True
            self.timing = message.get("timing", {})
            self.result = decode_outputs(message.get("outputs", {}))
            return None
        if kind == "error":
            self._done = True
            raise AgentError(str(message.get("code")), str(message.get("message")), self.request_id)
        return None  # a newer message type this SDK does not know: skip it

    def _chunk(self, message: dict[str, Any]) -> Chunk | None:
        index = int(message["index"])
        part = message.get("part")
        if part is None:
            outputs = decode_outputs(message["outputs"])
        else:
            k, n = int(part[0]), int(part[1])
            parts = self._parts.setdefault(index, [])
            parts.append(message)
            if k != n - 1 or len(parts) != n:
                return None
            del self._parts[index]
            outputs = wire.reassemble_parts([bytes(p["data"]) for p in parts])
        return Chunk(
            seq=int(message["seq"]),
            index=index,
            outputs=outputs,
            model=str(message.get("model")),
            version=int(message.get("version") or 0),
            ts=int(message.get("ts") or 0),
            received=time.perf_counter(),
        )

    def collect(self) -> Arrays:
        """Wait for the whole stream; chunks of every output are concatenated on axis 0.

        A `result` is returned as is.
        """
        chunks = list(self)
        if self.result is not None:
            return self.result
        if not chunks:
            return {}
        names = list(chunks[0].outputs)
        return {n: np.concatenate([c.outputs[n] for c in chunks], axis=0) for n in names}

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close(self)


class AgentClient:
    """A connection to the broker for talking to one agent (`device_id`)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        device_id: str,
        topic_prefix: str = "edge",
        protocol: str = "5",
        client_id: str | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        if protocol not in ("5", "3.1.1"):
            raise ValueError("protocol must be '5' or '3.1.1'")
        self.root = f"{topic_prefix}/{device_id}"
        self.topic_prefix = topic_prefix
        self._host, self._port, self._timeout = host, port, connect_timeout
        self.mqtt5 = protocol == "5"
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"edge-client-{uuid.uuid4().hex[:12]}",
            protocol=MQTTProtocolVersion.MQTTv5 if self.mqtt5 else MQTTProtocolVersion.MQTTv311,
        )
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls is not None:
            self._client.tls_set_context(tls)
        self._client.on_socket_open = _set_nodelay
        self._client.reconnect_delay_set(1, 2)
        self._client.on_connect = self._on_connect
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe
        self._connected = threading.Event()
        self._connect_error: str | None = None
        self._lock = threading.Lock()
        self._routes: dict[str, Reply] = {}
        self._listeners: list[
            tuple[str, Callable[[str, dict[str, Any] | None, bytes], None], int]
        ] = []
        self._subacks: dict[int, threading.Event] = {}

    # -- connection ----------------------------------------------------------------------------

    def connect(self) -> AgentClient:
        self._client.connect(self._host, self._port, keepalive=30)
        self._client.loop_start()
        if not self._connected.wait(self._timeout):
            self.close()
            raise ConnectionError(
                self._connect_error or f"no connection to {self._host}:{self._port}"
            )
        return self

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.disconnect()
        with contextlib.suppress(Exception):
            self._client.loop_stop()

    def __enter__(self) -> AgentClient:
        return self.connect()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, props: Any
    ) -> None:
        if reason.is_failure:
            self._connect_error = f"broker refused the connection: {reason}"
            return
        if self._connected.is_set():
            # A reconnect (the broker restarted): a clean session lost our subscriptions.
            with self._lock:
                topics = {reply.topic: 1 for reply in self._routes.values()}
                topics.update({pattern: qos for pattern, _, qos in self._listeners})
            for topic, qos in topics.items():
                client.subscribe(topic, qos)
        self._connected.set()

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: Any, props: Any
    ) -> None:
        with self._lock:
            event = self._subacks.pop(mid, None)
        if event is not None:
            event.set()

    def _subscribe(self, topic: str, qos: int) -> None:
        """Subscribe and wait for the SUBACK, so no early reply is missed."""
        event = threading.Event()
        with self._lock:
            result, mid = self._client.subscribe(topic, qos)
            if result != mqtt.MQTT_ERR_SUCCESS or mid is None:
                raise ConnectionError(f"cannot subscribe to {topic}: {mqtt.error_string(result)}")
            self._subacks[mid] = event
        if not event.wait(self._timeout):
            raise ConnectionError(f"no SUBACK for {topic}")

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            decoded: dict[str, Any] | None = wire.decode_payload(message.payload, REPLY_LIMITS)
        except wire.WireError:
            decoded = None
        with self._lock:
            reply = self._routes.get(message.topic)
            listeners = list(self._listeners)
        if reply is not None and decoded is not None:
            reply._deliver(decoded)
        for pattern, callback, _qos in listeners:
            if mqtt.topic_matches_sub(pattern, message.topic):
                with contextlib.suppress(Exception):
                    callback(message.topic, decoded, bytes(message.payload))

    # -- requests ------------------------------------------------------------------------------

    def request(
        self,
        model: str,
        inputs: Mapping[str, Array],
        *,
        request_id: str | None = None,
        stream: bool = True,
        priority: int | None = None,
        deadline_ms: int | None = None,
        qos: int = 1,
        reply_qos: int | None = None,
        version: int | None = None,
        params: Mapping[str, Any] | None = None,
        reply_to: str | None = None,
        timeout: float = 30.0,
        extra: Mapping[str, Any] | None = None,
        recover: bool = True,
    ) -> Reply:
        """Publish a request and return its reply stream (iterate it for the chunks).

        With `recover`, gaps and a stream gone quiet are asked for again on `ROOT/resend`.
        """
        request_id = request_id or uuid.uuid4().hex[:16]
        body: dict[str, Any] = {"id": request_id, "inputs": dict(inputs)}
        if not stream:
            body["stream"] = False
        optional = {
            "priority": priority,
            "deadline_ms": deadline_ms,
            "qos": reply_qos,
            "version": version,
            "params": dict(params) if params else None,
            "reply_to": reply_to,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if extra:
            body.update(extra)
        topic = reply_to or f"{self.root}/result/{model}/{request_id}"
        reply = self._new_reply(request_id, topic, model, timeout, recover)
        with self._lock:
            self._routes[topic] = reply
        self._subscribe(topic, max(qos, reply_qos or 0))
        self.publish_raw(f"{self.root}/infer/{model}", wire.encode_payload(body), qos)
        reply.sent_at = time.perf_counter()
        return reply

    def _new_reply(
        self, request_id: str, topic: str, model: str, timeout: float, recover: bool
    ) -> Reply:
        return Reply(
            request_id,
            topic,
            timeout,
            _on_close=self._forget,
            _ask=self._ask_resend if recover else None,
            model=model,
        )

    def _ask_resend(self, body: dict[str, Any]) -> None:
        self.publish_raw(f"{self.root}/resend", wire.encode_payload(body), 1)

    def replay(
        self,
        model: str,
        request_id: str,
        *,
        from_seq: int = 0,
        reply_to: str | None = None,
        timeout: float = 30.0,
    ) -> Reply:
        """The stream of an earlier request, asked for again from the agent's resend window
        (for a subscriber that was not there while it ran). Iterate it like any reply."""
        topic = reply_to or f"{self.root}/result/{model}/{request_id}"
        reply = self._new_reply(request_id, topic, model, timeout, True)
        reply._next_seq = from_seq
        with self._lock:
            self._routes[topic] = reply
        self._subscribe(topic, 1)
        body: dict[str, Any] = {"id": request_id, "from_seq": from_seq, "model": model}
        if reply_to is not None:
            body["reply_to"] = reply_to
        self._ask_resend(body)
        reply.resend_requests += 1
        return reply

    def infer(self, model: str, inputs: Mapping[str, Array], **options: Any) -> Arrays:
        """Request and wait for the whole output."""
        return self.request(model, inputs, **options).collect()

    def publish_raw(
        self, topic: str, payload: bytes, qos: int = 1, properties: Properties | None = None
    ) -> None:
        info = self._client.publish(topic, payload, qos, properties=properties)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise ConnectionError(f"publish failed: {mqtt.error_string(info.rc)}")

    def _forget(self, reply: Reply) -> None:
        with self._lock:
            self._routes.pop(reply.topic, None)
        with contextlib.suppress(Exception):
            self._client.unsubscribe(reply.topic)

    def listen(
        self,
        pattern: str,
        callback: Callable[[str, dict[str, Any] | None, bytes], None],
        qos: int = 1,
    ) -> None:
        """Call `callback(topic, decoded_or_None, raw)` for every message matching `pattern`."""
        with self._lock:
            self._listeners.append((pattern, callback, qos))
        self._subscribe(pattern, qos)

    def response_properties(self, response_topic: str, correlation: bytes) -> Properties:
        """MQTT 5 request properties: where to reply, and what to echo."""
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        props.ResponseTopic = response_topic
        props.CorrelationData = correlation
        return props


def _set_nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    # Without TCP_NODELAY every small chunk waits ~40 ms for the peer's delayed ACK.
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
