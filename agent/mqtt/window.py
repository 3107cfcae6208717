"""The in-flight window: what the outbox holds, published within the broker's limits, and
what the broker acknowledges, settled in the outbox.

At most min(`max_inflight`, the broker's Receive Maximum) QoS 1/2 publishes are unacknowledged
at a time (the broker would otherwise disconnect us, MQTT 5), and nothing is published above
the broker's Maximum QoS. On MQTT 3.1.1, where nothing announces a limit, no QoS 1/2 publish
goes out while `qos2_limit` QoS 2 flows are unfinished: Mosquitto acknowledges and drops any
QoS 1/2 publish past its quota of unreleased QoS 2 messages (decision 0024).

A message the broker would refuse, or has refused for good, is quarantined
(`agent.mqtt.poison`); so is one too large for the broker's packet limit (its Maximum Packet
Size, `[mqtt] max_packet_bytes`: the agent's shared `PacketLimit`, set here at every CONNACK),
its stream ended (`agent.mqtt.oversize`). A suspect of a lost connection (in flight when it was
lost) is published alone: after the messages before it are acknowledged, and nothing after it
until its own acknowledgement; found alone in flight at two more losses, it is quarantined.
Used by the holder of the transport's io lock only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.packet_limit import NO_LIMIT, PacketLimit
from agent.mqtt.oversize import Oversize
from agent.mqtt.paho_plain import Client
from agent.mqtt.poison import Quarantine

log = logging.getLogger(__name__)

PUBLISH_BATCH = 256  # messages taken from the outbox and written with one loop_write


class Window:
    """QoS 1/2 publishes awaiting their acknowledgement, and the publishing into the window."""

    def __init__(
        self,
        max_inflight: int,
        outbox: Outbox,
        qos2_limit: int = 65535,
        *,
        packet_limit: PacketLimit | None = None,
    ) -> None:
        """`packet_limit`: the agent's shared one, set here at every CONNACK."""
        self._max_inflight = max_inflight
        self.qos2_limit = qos2_limit
        self._outbox = outbox
        self.limit = max_inflight  # after the broker's Receive Maximum
        self.max_qos = 2
        # mid -> (publish time, message): QoS 1/2 awaiting the broker's acknowledgement.
        # Cleared in place (never replaced): the transport holds it too.
        self.pending: dict[int, tuple[float, OutMessage]] = {}
        self.qos2: set[int] = set()  # the ids in `pending` published at QoS 2
        # QoS 2 ids unfinished when the last connection ended: released (PUBREL) on the next
        # connection if the broker kept the session (`agent.mqtt.session`).
        self.unreleased: set[int] = set()
        self.acked = 0
        self.publish_failures = 0
        self._qos_warned = False
        self._ack_listeners: list[Callable[[float], None]] = []
        self.quarantine = Quarantine(outbox.forget)
        self._good_topics = self.quarantine.good  # the same set: one lookup per message
        self._suspects = self.quarantine.suspects  # the same dict: empty but after a loss
        self._alone: int | None = None  # the mid of a suspect out alone
        self._suspect_waits = False  # a suspect waits for the window to empty
        self.packet_limit = packet_limit or PacketLimit()
        self.oversize = Oversize(self.packet_limit, self.quarantine, outbox.put_nowait_reserved)
        self._ended = self.oversize.ended  # the same dict: empty but after a too large reply

    def add_ack_listener(self, listener: Callable[[float], None]) -> None:
        """Called with the acknowledgement latency (seconds) of every QoS 1/2 publish."""
        self._ack_listeners.append(listener)

    def apply_broker_limits(self, properties: Properties | None) -> None:
        """Receive Maximum bounds the window; Maximum QoS caps what we publish; Maximum Packet
        Size, with `[mqtt] max_packet_bytes`, bounds every packet (CONNACK)."""
        receive_max = getattr(properties, "ReceiveMaximum", None) if properties else None
        max_qos = getattr(properties, "MaximumQoS", None) if properties else None
        max_packet = getattr(properties, "MaximumPacketSize", None) if properties else None
        if self.packet_limit.announce(max_packet) < NO_LIMIT:
            log.info("mqtt: packets up to %d bytes", self.packet_limit.bytes)
        self.limit = min(self._max_inflight, receive_max or 65535)
        self.max_qos = 2 if max_qos is None else int(max_qos)
        if self.max_qos < 2:
            log.info("mqtt: the broker accepts QoS <= %d", self.max_qos)

    def full(self) -> bool:
        """No QoS 1/2 publish may go out now (the window or the QoS 2 quota is taken, or a
        suspect is out alone or waits to be)."""
        return (
            len(self.pending) >= self.limit
            or len(self.qos2) >= self.qos2_limit
            or self._alone is not None
            or (self._suspect_waits and bool(self.pending))
        )

    def new_connection(self) -> None:
        """A new client: what was in flight is published again from the spool; the QoS 2
        ids among it are kept to be released if the broker resumes the session. Added to
        those kept before: an attempt that ends before its CONNACK publishes nothing, and
        the flows of the last connection that ran still wait for the one that resumes."""
        self.unreleased |= self.qos2
        self.qos2.clear()
        self.pending.clear()
        self._alone = None
        self._suspect_waits = False

    def oldest_sent(self) -> float | None:
        """The publish time of the oldest message awaiting its acknowledgement."""
        return min((sent for sent, _ in self.pending.values()), default=None)

    def publish_batch(self, client: Client) -> bool:
        """Publish what the outbox holds, up to the window; True when more may be waiting."""
        room = self.limit - len(self.pending)
        if room <= 0 or self._alone is not None or client.want_write():
            # The window is full, or the socket has not taken the last write yet: messages
            # stay in the outbox, whose bound pushes back on the producers (QoS 0 has no
            # window, so a stalled broker would otherwise grow paho's buffer without end).
            return False
        if self._suspect_waits and self.pending:
            return False  # a suspect, first in the outbox, waits for the window to empty
        messages = self._outbox.take(min(PUBLISH_BATCH, room))
        if not messages:
            return False
        suspects = self._suspects
        for n, message in enumerate(messages):
            if suspects and message.stored_id in suspects:
                return self._publish_alone(client, messages[n:])
            if not self._publish(client, message):
                self._unget(messages[n:])
                return False
        return True

    def _publish_alone(self, client: Client, messages: list[OutMessage]) -> bool:
        """`messages[0]` is a suspect: published once nothing is in flight, and nothing after
        it until its acknowledgement (or the connection's loss). False: wait."""
        suspect = messages[0]
        self._suspect_waits = bool(self.pending)
        if self._suspect_waits or not self._publish(client, suspect):
            self._unget(messages)
            return False
        self._unget(messages[1:])
        if suspect.stored_id not in self._suspects:
            return True  # settled as it went: quarantined, or sent at QoS 0
        self._alone = next(reversed(self.pending))  # its mid: the latest in flight
        return False

    def _unget(self, messages: list[OutMessage]) -> None:
        for back in reversed(messages):
            self._outbox.unget(back)

    def _publish(self, client: Client, message: OutMessage) -> bool:
        """False when the connection is gone or the QoS 2 quota is taken (the message goes
        back to the outbox)."""
        if message.topic not in self._good_topics and self.quarantine.refuses(message):
            return True  # never published: a topic the broker would refuse
        if self._ended and self.oversize.drops(message):
            return True  # never published: its stream was ended as too large
        qos = message.qos
        if qos > self.max_qos:
            if not self._qos_warned:
                log.warning(
                    "mqtt: the broker refuses QoS %d; publishing at QoS %d", qos, self.max_qos
                )
                self._qos_warned = True
            qos = self.max_qos
        if self.oversize.refuses(message, qos):
            return True  # never published: too large for the broker's packets
        if qos and len(self.qos2) >= self.qos2_limit:
            return False  # the broker's QoS 2 quota is taken: wait for a PUBCOMP
        sent = time.monotonic()
        try:
            rc, mid = client.publish_fast(
                message.topic, message.payload, qos, message.retain, message.properties
            )
        except (ValueError, TypeError) as e:
            self.publish_failures += 1
            self.quarantine.quarantine(message, f"paho refuses it: {e}")  # it can never go out
            return True
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return False  # no connection (or no free message id): published again later
        if qos == 0:
            if message.spool_id is not None:
                self._outbox.acknowledged(message.spool_id)  # downgraded to QoS 0: sent is all
            if self._suspects:
                self.quarantine.acknowledged(message)
        else:
            # Acknowledgements are read by this thread only after this returns: no race.
            self.pending[mid] = (sent, message)
            if qos == 2:
                self.qos2.add(mid)
        return True

    def acknowledged(self, mid: int, reason: ReasonCode) -> None:
        """The broker's PUBACK or PUBCOMP of a QoS 1/2 publish (the client's `acknowledged`)."""
        pending = self.pending.pop(mid, None)
        if pending is None:
            return  # not ours, or not on this connection: nothing to settle
        sent, message = pending
        self.qos2.discard(mid)
        if mid == self._alone:
            self._alone = None
        if reason.is_failure:
            # A permanent refusal is quarantined (resending it would only loop); a transient
            # one (quota) stays pending in the spool, published again after a reconnect.
            self.publish_failures += 1
            self.quarantine.refused(message, int(reason.value), str(reason))
            return
        spool_id = message.spool_id
        if spool_id is not None:
            self._outbox.acknowledged(spool_id)
        if self._suspects:
            self.quarantine.acknowledged(message)
        self.acked += 1
        latency = time.monotonic() - sent
        for listener in self._ack_listeners:
            listener(latency)

    def connection_lost(self, code: int, reason: str) -> None:
        """The broker or the network ended the connection (DISCONNECT reason `code`, named
        `reason`): what was in flight tells the quarantine its suspects
        (`Quarantine.connection_lost`)."""
        in_flight = [message for _, message in self.pending.values()]
        self.quarantine.connection_lost(in_flight, code, reason)
