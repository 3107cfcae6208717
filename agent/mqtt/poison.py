"""Messages that are never published again: the quarantine.

One message can take a box offline for good: Mosquitto drops the connection of a client that
publishes on a topic with a control character, and a QoS 1 message on it stays in the spool,
is published again after every reconnect (and every restart) and drops the connection again.
Three ways in, one way out:

* a topic the broker would refuse (`topic_problem`) is never published, whether the message
  was just queued, read back from the spool or resent;
* a permanent refusal in an MQTT 5 PUBACK/PUBCOMP (`PERMANENT_REFUSALS`: not authorized,
  topic name invalid, packet too large, payload format invalid) is not retried; a transient
  one (quota exceeded, unspecified, ...) leaves the message pending in the spool: it is
  published again after the next reconnect, never in a loop on one connection;
* a message that was in flight when the broker ended the connection for a reason a message
  can cause (`MESSAGE_FAULTS`: the socket closed or reset, a malformed packet, ...; not a
  keepalive timeout nor a session taken over) is a suspect until it is acknowledged. A
  suspect goes out alone on the next connections (`agent.mqtt.window`); a suspect alone in
  flight at `ALONE_LOSSES` more such losses is the poison. Mosquitto may close the connection
  before the acknowledgements of the messages ahead of a poison are read, so every message
  in flight is a suspect, and going out one at a time tells them apart: an innocent message
  is convicted only if the broker ends the connection while it is in flight, and then twice
  more in the round trips it spends alone in flight (decision 0055).

Each is quarantined: forgotten by the spool (deleted, never marked acknowledged, so neither
a reconnect nor a resend brings it back), counted, logged once per topic with the topic
escaped and truncated, and passed to `on_refused(topic, reason, first)` (the agent counts it
and reports the first of a topic as a `publish_refused` event).

Used by the holder of the transport's io lock only (`agent.mqtt.window`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from agent.delivery.outbox import OutMessage
from agent.protocol.topics import publish_problem

log = logging.getLogger(__name__)

# MQTT 5 reason codes that refuse this message whatever the time or the connection.
PERMANENT_REFUSALS = frozenset({0x87, 0x90, 0x95, 0x99})
# DISCONNECT reasons (the broker's, or paho's 0x80 for a closed or reset socket) that a
# published message can cause: unspecified, malformed packet, protocol error, implementation
# specific, not authorized, topic name invalid, packet too large, payload format invalid,
# retain not supported, QoS not supported.
MESSAGE_FAULTS = frozenset({0x80, 0x81, 0x82, 0x83, 0x87, 0x90, 0x95, 0x99, 0x9A, 0x9B})
ALONE_LOSSES = 2  # a suspect alone in flight at this many losses is the poison
MAX_SUSPECTS = 1 << 16  # past this many, the suspects are forgotten (each costs a round trip)
REMEMBERED = 1024  # topics remembered as checked (good) or reported (bad), then forgotten
TRANSIENT_LOG_S = 30.0  # a transient refusal is logged again at most this often


def topic_problem(topic: str) -> str | None:
    """Why the broker would refuse (or drop the connection over) a publish on `topic`; None
    when it would not (the protocol's check, `agent.protocol.topics.publish_problem`)."""
    return publish_problem(topic)


def _no_report(topic: str, reason: str, first: bool) -> None:
    """`Quarantine.on_refused` until the transport sets its own."""


class Quarantine:
    """What never goes out again; `forget(spool_id)` deletes a spooled message for good."""

    def __init__(self, forget: Callable[[int], None]) -> None:
        self._forget = forget
        self.on_refused: Callable[[str, str, bool], None] = _no_report
        self.count = 0  # messages quarantined
        # Spool id -> losses it was alone in flight at, for the messages in flight at a loss a
        # message can cause, unacknowledged since: each goes out alone. Changed in place
        # (never replaced): the window holds it too.
        self.suspects: dict[int, int] = {}
        # Topics checked and found good (a stream publishes many messages to one); emptied,
        # never replaced, when full: the window reads it directly.
        self.good: set[str] = set()
        self._reported: set[str] = set()
        self._transient_logged = -TRANSIENT_LOG_S

    def refuses(self, message: OutMessage) -> bool:
        """Whether `message` must not be published (then it is quarantined here). A topic
        seen before costs one set lookup."""
        topic = message.topic
        if topic in self.good:
            return False
        problem = topic_problem(topic)
        if problem is None:
            if len(self.good) >= REMEMBERED:
                self.good.clear()
            self.good.add(topic)
            return False
        self.quarantine(message, problem)
        return True

    def refused(self, message: OutMessage, code: int, reason: str) -> bool:
        """The broker refused `message` with MQTT 5 reason `code`: quarantined when that is
        permanent (True); a transient refusal is logged (False: it stays pending)."""
        if code in PERMANENT_REFUSALS:
            self.quarantine(message, f"refused by the broker: {reason} (0x{code:02x})")
            return True
        now = time.monotonic()
        if now - self._transient_logged >= TRANSIENT_LOG_S:
            self._transient_logged = now
            log.warning(
                "mqtt: the broker refused a publish on %s for now: %s (0x%02x); it is "
                "published again after the next reconnect",
                _shown(message.topic),
                reason,
                code,
            )
        return False

    def quarantine(self, message: OutMessage, reason: str) -> None:
        """Never publish `message` again: forgotten by the spool, counted, reported."""
        self.count += 1
        stored = message.stored_id  # a resend's copy: the stored message it copies
        if stored is not None:
            self._forget(stored)
            self.suspects.pop(stored, None)
        topic = message.topic
        first = topic not in self._reported
        if first:
            if len(self._reported) >= REMEMBERED:
                self._reported.clear()
            self._reported.add(topic)
            log.error(
                "mqtt: a message on %s is quarantined, never published again: %s",
                _shown(topic),
                reason,
            )
        try:
            self.on_refused(topic, reason, first)
        except Exception:
            log.exception("mqtt: reporting a quarantined message failed")

    def acknowledged(self, message: OutMessage) -> None:
        """The broker took `message` (acknowledged, or sent at QoS 0): no suspect."""
        stored = message.stored_id
        if stored is not None:
            self.suspects.pop(stored, None)

    def connection_lost(self, in_flight: Iterable[OutMessage], code: int, reason: str) -> None:
        """The broker or the network ended the connection (not the agent) with DISCONNECT
        reason `code` (named `reason`) and `in_flight` unacknowledged. For a reason a message
        can cause, every spooled message in flight (or a resend's copy of one) is a suspect,
        and a suspect alone in flight (out alone, as suspects go) at `ALONE_LOSSES` more losses
        is quarantined. A loss with nothing stored in flight clears the suspects."""
        if code not in MESSAGE_FAULTS:
            return  # the link or the broker's own state, not what we published
        stored = [(m.stored_id, m) for m in in_flight if m.stored_id is not None]
        if not stored:  # spooled messages, or copies of them
            self.suspects.clear()
            return
        suspects = self.suspects
        if len(stored) == 1 and stored[0][0] in suspects:  # out alone as a suspect
            alone, message = stored[0]
            suspects[alone] += 1
            if suspects[alone] >= ALONE_LOSSES:
                why = f"alone in flight at {ALONE_LOSSES} lost connections ({reason}, 0x{code:02x})"
                self.quarantine(message, why)
            return
        if len(suspects) + len(stored) > MAX_SUSPECTS:
            suspects.clear()
        for stored_id, _ in stored:
            suspects.setdefault(stored_id, 0)


def _shown(topic: str) -> str:
    """A topic for a log line: escaped (repr) and truncated."""
    shown = repr(topic)
    return shown if len(shown) <= 200 else shown[:200] + "..."
