"""What the daemon does when the connection's state changes (called on the mqtt-io thread).

The transport (`agent.mqtt.connection.Transport`) knows nothing of models, status or the
spool's replay; it calls these hooks: a new connection's birth message and inventory, the
spooled messages to publish again on a new session, a message the broker refused for good,
the broker having kept no session. Each is small; together they are the daemon's side of
the connection, kept apart from the wiring in `agent.service.agent`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.config import AgentConfig
from agent.delivery.outbox import Outbox
from agent.models.manager import ModelManager
from agent.ops.counters import Counters
from agent.service.announce import Announcer

log = logging.getLogger(__name__)

REPLAY_LOG_S = 60.0  # a replay that keeps failing is logged at most this often


class ConnectionHooks:
    """The connection's callbacks; `epoch` is the current connection's (0 before the first)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        outbox: Outbox,
        announcer: Announcer,
        models: ModelManager,
        counters: Counters,
        publish_event: Callable[[dict[str, Any]], None],
        connected: Callable[[], bool],
        replay: Callable[[], None] = lambda: None,
    ) -> None:
        """`connected`: whether the broker is connected now (the transport's, set later);
        `replay`: runs the requests stored before a crash, once, at the first connection."""
        self.config = config
        self.epoch = 0
        self._outbox = outbox
        self._announcer = announcer
        self._models = models
        self._counters = counters
        self._publish_event = publish_event
        self._connected = connected
        self._replay: Callable[[], None] | None = replay
        self._replay_logged = -REPLAY_LOG_S

    def on_connected(self, epoch: int) -> None:
        """Birth message and inventory go out before anything queued. At the first
        connection, the stored requests run again: after its CONNACK, which announces the
        broker's packet limit (MQTT 5), that their replies' parts are sized by."""
        self.epoch = epoch
        self._outbox.unget(self._announcer.inventory_message(self._models.inventory()))
        self._outbox.unget(self._announcer.status_message("online", epoch))
        self.retry_replay()

    def retry_replay(self) -> None:
        """The stored requests' replay, until it succeeds: a spool that cannot be written
        (a full or read-only disk) fails it; then every tick tries it again (the transport's
        `on_tick`, on the io thread), and the requests it ran before failing are not run
        twice (`agent.service.crash_replay`)."""
        replay = self._replay
        if replay is None:
            return
        try:
            replay()
        except Exception as e:  # a spool that cannot be written, above all: never the io thread
            now = time.monotonic()
            if now >= self._replay_logged + REPLAY_LOG_S:
                self._replay_logged = now
                log.error("replaying the stored requests failed (%s): tried again till it works", e)
            return
        self._replay = None

    def on_new_session(self, lost_at: float | None) -> None:
        """Before a new connection: what was in flight goes out again from the spool, and so
        does what the broker acknowledged just before the connection was lost (it may have
        crashed before saving it)."""
        window = self.config.mqtt.replay_after_reconnect_s
        since = None if lost_at is None or window <= 0 else lost_at - window
        pending = self._outbox.rewind(unack_since=since)
        if pending:
            log.info("mqtt: %d spooled message(s) to publish on the new connection", pending)

    def publish_inventory(self) -> None:
        """The models' inventory changed. While disconnected nothing is queued: the next
        connection publishes the current one."""
        if self._connected():
            self._announcer.inventory(self._models.inventory())

    def publish_refused(self, topic: str, reason: str, first: bool) -> None:
        """A message quarantined (never published again): counted; the first on its topic
        is reported on `ROOT/events` (the topic as text, undecodable characters escaped)."""
        self._counters.add("messages_quarantined")
        if first:
            shown = topic[:300].encode("utf-8", "backslashreplace").decode("utf-8")
            self._publish_event({"type": "publish_refused", "topic": shown, "reason": reason})

    def session_lost(self) -> None:
        """The broker kept no session for the agent (`agent.mqtt.session`): counted, and
        reported on `ROOT/events` (requests published while it was away may be lost)."""
        self._counters.add("broker_session_lost")
        self._publish_event({"type": "broker_session_lost"})
