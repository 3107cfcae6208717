"""Received messages: handed to the agent's handler as `Incoming`, then acknowledged, at once
or (QoS 1/2 requests) once the handler says they are stored.

Messages come from the fast client's reader (`deliver`) or from paho's `on_message` (what
the fast reader leaves to paho, and everything under the plain client), always on the holder
of the transport's io lock. A deferred acknowledgement may be queued from any thread; it is
sent by the next holder of the lock, on the connection the message came on or not at all
(the broker delivers it again on the next one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties

from agent.mqtt.messages import Incoming, RequestProperties
from agent.mqtt.paho_plain import Client

log = logging.getLogger(__name__)


class Inbound:
    """The way in of one transport: delivery to `on_message`, acknowledgements."""

    def __init__(self, on_message: Callable[[Incoming], None], mqtt5: bool) -> None:
        self._on_message = on_message
        self._mqtt5 = mqtt5
        self.client: Client | None = None  # the current connection's (set by the transport)
        self.connection = 0  # counts connections: a deferred acknowledgement belongs to one
        self._acks_lock = threading.Lock()
        self.deferred: list[tuple[int, int, int]] = []  # (connection, mid, qos) to send

    def defer(self, incoming: Incoming) -> Callable[[], None]:
        """Take over the acknowledgement of `incoming` (QoS 1/2): the returned function, called
        from any thread once the message is safe, queues it; the caller has it sent (the
        spool writer kicks the outbox once after a batch's callbacks). An acknowledgement that
        comes after its connection was lost is dropped: the broker delivers the message again."""
        incoming.deferred = True
        connection, mid, qos = self.connection, incoming.mid, incoming.qos

        def ack() -> None:
            with self._acks_lock:
                self.deferred.append((connection, mid, qos))

        return ack

    def send_deferred(self, client: Client) -> None:
        """Under the io lock: the deferred acknowledgements queued so far, of this connection."""
        if not self.deferred:
            return
        with self._acks_lock:
            acks, self.deferred = self.deferred, []
        for connection, mid, qos in acks:
            if connection != self.connection:
                continue  # the broker delivers it again on the new connection
            if qos == 1:
                client.puback_fast(mid)
            else:
                client.ack(mid, qos)

    def handle_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        """paho's way in: QoS 2, other properties, what the fast path leaves to paho."""
        self.deliver(
            message.topic,
            bytes(message.payload),
            message.qos,
            message.mid,
            bool(message.dup),
            getattr(message, "properties", None) if self._mqtt5 else None,
            bool(message.retain),
        )

    def deliver(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        mid: int,
        dup: bool,
        props: RequestProperties | Properties | None,
        retain: bool = False,
    ) -> None:
        """A received message, from the fast client's reader or from paho (io lock held)."""
        incoming = Incoming(
            topic=topic,
            payload=payload,
            qos=qos,
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=getattr(props, "CorrelationData", None),
            dup=dup,
            mid=mid,
            retain=retain,
        )
        try:
            self._on_message(incoming)
        except Exception:
            # One failing handler never stops the network loop.
            log.exception("mqtt: message handler failed for topic %s", topic[:200])
        # Unless the handler took it over (a request acknowledged once stored), the broker
        # may forget the message now (a crash before this line means a redelivery, no loss).
        if qos > 0 and not incoming.deferred and self.client is not None:
            self.client.ack(mid, qos)
