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
* the oldest spooled message in flight at `SUSPECT_DROPS` lost connections in a row (not
  acknowledged in between) is the suspect of an unknown poison.

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
SUSPECT_DROPS = 2  # lost connections in a row with the same oldest message in flight
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
        self.suspect: int | None = None  # the spool id of the oldest in flight at the last loss
        self._drops = 0
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
        if message.spool_id is not None:
            self._forget(message.spool_id)
            if message.spool_id == self.suspect:
                self.cleared()
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

    def cleared(self) -> None:
        """The suspect was acknowledged (or is gone): no suspect."""
        self.suspect = None
        self._drops = 0

    def connection_lost(self, in_flight: Iterable[OutMessage]) -> None:
        """The broker or the network ended the connection (not the agent) with `in_flight`
        unacknowledged: the oldest spooled one is the suspect; at `SUSPECT_DROPS` losses in a
        row with the same suspect it is quarantined."""
        spooled = [m for m in in_flight if m.spool_id is not None]
        if not spooled:
            self.cleared()
            return
        oldest = min(spooled, key=lambda m: m.spool_id or 0)
        if oldest.spool_id == self.suspect:
            self._drops += 1
        else:
            self.suspect, self._drops = oldest.spool_id, 1
        if self._drops >= SUSPECT_DROPS:
            reason = f"in flight at {SUSPECT_DROPS} lost connections in a row, unacknowledged"
            self.quarantine(oldest, reason)


def _shown(topic: str) -> str:
    """A topic for a log line: escaped (repr) and truncated."""
    shown = repr(topic)
    return shown if len(shown) <= 200 else shown[:200] + "..."
