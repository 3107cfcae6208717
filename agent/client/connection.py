"""The connection to the broker for talking to one agent: connecting (and subscribing again
after a reconnect), publishing requests and resend requests, and routing each message on a
reply topic to its `Reply` (agent.client.reply) or to a listener.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.client.reply import REPLY_LIMITS, Arrays, Reply
from agent.models.backends.base import Array
from agent.protocol.errors import WireError
from agent.protocol.payload import decode_payload, encode_payload


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
            decoded: dict[str, Any] | None = decode_payload(message.payload, REPLY_LIMITS)
        except WireError:
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
        inputs: Mapping[str, Array | bytes | str],
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
        compress: bool = False,
    ) -> Reply:
        """Publish a request and return its reply stream (iterate it for the chunks).

        With `recover`, gaps and a stream gone quiet are asked for again on `ROOT/resend`.
        An input may be `bytes` holding a JPEG or PNG (for a model with `[preprocess]`).
        `compress`: the request goes as a zstd frame where that is smaller.
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
        payload = encode_payload(body, compress_over=0 if compress else None)
        self.publish_raw(f"{self.root}/infer/{model}", payload, qos)
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
        self.publish_raw(f"{self.root}/resend", encode_payload(body), 1)

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

    def cancel(self, request_id: str) -> None:
        """Ask the agent to stop a running or queued request (`ROOT/cancel`): its stream
        ends with `end`, `finish_reason: "cancelled"`. Unknown or finished ids are ignored."""
        self.publish_raw(f"{self.root}/cancel", encode_payload({"id": request_id}), 1)

    def infer(
        self, model: str, inputs: Mapping[str, Array | bytes | str], **options: Any
    ) -> Arrays:
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
