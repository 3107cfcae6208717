"""paho's own client with the small interface the transport drives: the plain way.

`Client` overrides no method of paho and uses only its public API. It is what
`agent.mqtt.paho_fast.new_client` returns where the fast client cannot be trusted, and the
base of that fast client (which overrides paho's reading and writing behind the same
interface), so the transport has one code path whichever it gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.mqtt.messages import RequestProperties


def _no_delivery(
    topic: str,
    payload: bytes,
    qos: int,
    mid: int,
    dup: bool,
    props: RequestProperties | None,
    retain: bool,
) -> None:
    """`Client.deliver` until a transport sets its own."""


def _no_acknowledgement(mid: int, reason: ReasonCode) -> None:
    """`Client.acknowledged` until a transport sets its own."""


class Client(mqtt.Client):
    """paho's own client (no method of it overridden) with the interface the transport uses:

    * `publish_fast(topic, payload, qos, retain, properties) -> (rc, mid)` publishes at any
      QoS (here: paho's `publish`);
    * `puback_fast(mid)` acknowledges a QoS 1 message (here: paho's `ack`);
    * `acknowledged(mid, reason)` is called with the PUBACK or PUBCOMP of every QoS 1/2
      message `publish_fast` published (here from paho's `on_publish`, which is this
      class's own: paho calls it for a written QoS 0 message too, whose id may repeat one
      still awaiting its PUBACK, so those calls are not passed on);
    * `deliver(topic, payload, qos, mid, dup, properties, retain)` is called for a message the fast
      reader read (never here: messages come through paho's `on_message`);
    * `unsent()`, bytes published that the socket has not taken (paho does not say: 0);
    * `release(mids)` sends PUBREL for QoS 2 ids of the previous connection (a resumed
      session), never used again on this client (the fast client only: here a no-op).

    A QoS 2 publish whose PUBREC refused it (MQTT 5; paho ignores it and sends PUBREL) is
    reported with the PUBREC's reason where the client saw it (`pubrec_refused`: the fast
    client), not as the PUBCOMP's success.
    """

    MID_TRIES = 16  # paho refuses an id still in flight; the next one is free (window < 65535)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (topic, payload, qos, mid, dup, properties, retain) of a PUBLISH the fast path read.
        self.deliver: Callable[[str, bytes, int, int, bool, RequestProperties | None, bool], None]
        self.deliver = _no_delivery
        self.acknowledged: Callable[[int, ReasonCode], None] = _no_acknowledgement
        self._qos0_unwritten: dict[int, int] = {}  # id -> QoS 0 publishes not yet written
        self.pubrec_refused: dict[int, ReasonCode] = {}  # QoS 2 ids a PUBREC refused
        self.on_publish = self._published

    def unsent(self) -> int:
        return 0

    def publish_fast(
        self, topic: str, payload: bytes, qos: int, retain: bool, properties: Properties | None
    ) -> tuple[MQTTErrorCode, int]:
        """paho's `publish`: `(rc, mid)`, mid 0 for QoS 0; ValueError where paho refuses."""
        rc, mid = self._publish_paho(topic, payload, qos, retain, properties)
        if qos:
            return rc, mid
        if rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
            self._qos0_unwritten[mid] = self._qos0_unwritten.get(mid, 0) + 1
        return rc, 0

    def _publish_paho(
        self, topic: str, payload: bytes, qos: int, retain: bool, properties: Properties | None
    ) -> tuple[MQTTErrorCode, int]:
        """paho's `publish`, again with the next id where paho refused one still in flight."""
        for _ in range(self.MID_TRIES):
            info = self.publish(topic, payload, qos, retain, properties)
            if info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
                break
        return info.rc, info.mid

    def puback_fast(self, mid: int) -> None:
        self.ack(mid, 1)

    def release(self, mids: set[int]) -> None:
        """PUBREL for QoS 2 ids of the previous connection: paho has no public way to send
        one, so this client leaves them to the broker's session (the fast client sends them,
        `agent.mqtt.paho_fast`)."""

    def _published(
        self,
        client: mqtt.Client,
        userdata: Any,
        mid: int,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        """paho's `on_publish`: the acknowledgement of a QoS 1/2 message, passed on, or the
        write of a QoS 0 one, dropped."""
        unwritten = self._qos0_unwritten.get(mid)
        if unwritten:
            if unwritten == 1:
                del self._qos0_unwritten[mid]
            else:
                self._qos0_unwritten[mid] = unwritten - 1
            return
        refused = self.pubrec_refused.pop(mid, None) if self.pubrec_refused else None
        self.acknowledged(mid, reason if refused is None or reason.is_failure else refused)
