"""What the agent says about itself on its own topics: status, inventory, events, telemetry.

Every message here goes through the outbox's reserve (`put_nowait_reserved`): none of them
may ever block the thread that says it (the network thread announces the birth message, a
model load announces an event). The status is retained and carries the connection `epoch`,
so a late will of an older connection can be told apart from the current state.

Bad input without a readable id has nobody to answer: it is counted and reported on
`events` as `bad_request`, at most once a second, with the count and the last reason.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from agent import __version__
from agent.config import AgentConfig
from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.spool_items import Eviction
from agent.delivery.spool_open import Quarantine
from agent.mqtt.epoch import EpochRecovery
from agent.ops.counters import Counters
from agent.ops.metrics import AgentMetrics
from agent.protocol.payload import encode_payload

log = logging.getLogger(__name__)

BAD_REQUEST_REPORT_S = 1.0  # bad input with no readable id is reported at most this often


class Announcer:
    """Builds and queues the agent's own messages; `note_bad_request` from any thread."""

    def __init__(
        self,
        config: AgentConfig,
        outbox: Outbox,
        *,
        counters: Counters,
        metrics: AgentMetrics,
        started_at: str,
    ) -> None:
        self.config = config
        self._outbox = outbox
        self._counters = counters
        self._metrics = metrics
        self._started_at = started_at
        self._bad_lock = threading.Lock()
        self._bad_unreported = 0
        self._bad_last_reason = ""
        self._bad_last_report = 0.0

    def status_message(self, state: str, epoch: int) -> OutMessage:
        """The retained `ROOT/status`: `online` (birth), `offline` (will and clean stop)."""
        payload = {
            "state": state,
            "agent_version": __version__,
            "device": self.config.device_id,
            "started_at": self._started_at,
            "epoch": epoch,
        }
        return OutMessage(
            f"{self.config.root_topic}/status",
            encode_payload(payload),
            self.config.mqtt.qos.status,
            True,
        )

    def inventory_message(self, inventory: dict[str, Any]) -> OutMessage:
        """The retained `ROOT/models`."""
        return OutMessage(
            f"{self.config.root_topic}/models",
            encode_payload(inventory),
            self.config.mqtt.qos.status,
            True,
        )

    def inventory(self, inventory: dict[str, Any]) -> None:
        self._outbox.put_nowait_reserved(self.inventory_message(inventory))

    def event(self, event: dict[str, Any]) -> None:
        """An event on `ROOT/events` (spooled at QoS 1/2, like replies)."""
        body = {"type": event["type"], "ts": time.time_ns(), **event}
        message = OutMessage(
            f"{self.config.root_topic}/events",
            encode_payload(body),
            self.config.mqtt.qos.event,
            stream="events",
        )
        if not self._outbox.put_nowait_reserved(message):
            self._counters.add("events_dropped")
        if event["type"] == "model_loaded" and isinstance(event.get("load_s"), float | int):
            self._metrics.model_loaded(str(event.get("model")), float(event["load_s"]))

    def spool_overflow(self, eviction: Eviction) -> None:
        """`drop_oldest` made room: which streams lost pending messages. Not spooled itself:
        it is about the spool having no room."""
        self._counters.add("spool_evicted_messages", eviction.messages)
        log.warning(
            "spool full: evicted %d pending message(s) of %d stream(s)",
            eviction.messages,
            len(eviction.streams),
        )
        event = {
            "type": "spool_overflow",
            "policy": "drop_oldest",
            "messages": eviction.messages,
            "bytes": eviction.bytes,
            "streams": list(eviction.streams[:50]),
        }
        body = {"ts": time.time_ns(), **event}
        self._outbox.put_nowait_reserved(
            OutMessage(
                f"{self.config.root_topic}/events",
                encode_payload(body),
                self.config.mqtt.qos.event,
            )
        )

    def state_recovered(
        self, quarantine: Quarantine | None, recovery: EpochRecovery | None
    ) -> None:
        """At start: a corrupt spool moved aside (`spool_quarantined`), an epoch file that
        could not be read (`epoch_recovered`); each counted, logged where it was found."""
        if quarantine is not None:
            self._counters.add("spool_quarantined")
            self.event(
                {
                    "type": "spool_quarantined",
                    "path": str(quarantine.path),
                    "reason": quarantine.reason,
                }
            )
        if recovery is not None:
            self._counters.add("epoch_recovered")
            self.event(
                {
                    "type": "epoch_recovered",
                    "path": str(recovery.path),
                    "reason": recovery.reason,
                    "source": recovery.source,
                    "epoch": recovery.epoch,
                }
            )

    def telemetry(self, snapshot: dict[str, Any]) -> None:
        self._outbox.put_nowait_reserved(
            OutMessage(
                f"{self.config.root_topic}/telemetry",
                encode_payload(snapshot),
                self.config.mqtt.qos.telemetry,
            )
        )

    # -- bad input without an id -------------------------------------------------------------

    def note_bad_request(self, reason: str) -> None:
        now = time.monotonic()
        with self._bad_lock:
            self._bad_unreported += 1
            self._bad_last_reason = reason
            due = now - self._bad_last_report >= BAD_REQUEST_REPORT_S
        if due:
            self.report_bad_requests()

    def report_bad_requests(self, now: float | None = None) -> None:
        """Publish the count since the last report (housekeeping calls this every tick)."""
        if now is not None and now - self._bad_last_report < BAD_REQUEST_REPORT_S:
            return
        with self._bad_lock:
            count, self._bad_unreported = self._bad_unreported, 0
            reason = self._bad_last_reason
            if count:
                self._bad_last_report = time.monotonic()
        if count:
            self.event({"type": "bad_request", "count": count, "reason": reason[:300]})
