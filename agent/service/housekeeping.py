"""The `housekeeping` thread: what the agent does on a clock rather than on a message.

Every tick: report bad input without an id (rate-limited), publish telemetry when its period
came, expire spooled messages past their TTL and forget acknowledged ones past the resend
window, nudge the spool writer for whatever was queued outside a request, and ping the
systemd watchdog while healthy. Ticks are short while READY has not gone out, then often
enough for the watchdog.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from agent.config import AgentConfig
from agent.delivery.outbox import Outbox
from agent.delivery.spool import Spool
from agent.ops.box import BoxMonitor
from agent.ops.counters import Counters
from agent.ops.metrics import AgentMetrics
from agent.ops.systemd import ServiceReporter
from agent.service.announce import Announcer
from agent.service.health import Health
from agent.threads import NamedThread

log = logging.getLogger(__name__)

FAILURE_LOG_S = 60.0  # a tick that keeps failing is logged at most this often
PRUNE_METRICS_S = 30.0  # how often the series of removed models and versions are dropped


class Housekeeping:
    """`start()`, then `join()` after the agent's stop event is set; `config` follows reloads."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        stop: threading.Event,
        announcer: Announcer,
        outbox: Outbox,
        spool: Spool | None,
        counters: Counters,
        reporter: ServiceReporter,
        health: Health,
        telemetry: Callable[[], dict[str, Any]],
        metrics: AgentMetrics | None = None,
        expire_sessions: Callable[[], None] = lambda: None,
    ) -> None:
        """`expire_sessions()`: drop the scan sessions past their TTL (every tick)."""
        self.config = config
        self._expire_sessions = expire_sessions
        self._metrics = metrics
        self._metrics_pruned = 0.0
        self._stop = stop
        self._announcer = announcer
        self._outbox = outbox
        self._spool = spool
        self._counters = counters
        self._reporter = reporter
        self._health = health
        self._telemetry = telemetry
        self._spool_maintained = 0.0
        self._last_telemetry = 0.0
        self._thread = NamedThread(target=self._run, name="housekeeping", daemon=True)
        self.box = _box_monitor(config, metrics, announcer)
        health.box = self.box

    def start(self) -> None:
        self._thread.start()
        if self.box is not None:
            self.box.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.box is not None:
            self.box.close(timeout)

    def _run(self) -> None:
        self._last_telemetry = time.monotonic()
        failed_at = -FAILURE_LOG_S
        while not self._stop.wait(self._tick_s()):
            now = time.monotonic()
            try:
                self._tick(now)
            except Exception:  # a spool that cannot be written, say: the next tick tries again,
                # and the watchdog pings (in `_tick`, first) go on: a restart frees no disk
                if now - failed_at >= FAILURE_LOG_S:
                    failed_at = now
                    log.exception("housekeeping: a tick failed (tried again every tick)")

    def _tick(self, now: float) -> None:
        if self._reporter.notifier.enabled:
            self._reporter.tick(
                ready=self._health.transport.subscribed.is_set(),
                problem=self._health.problem(),
                status=self._health.status(),
            )
        self._announcer.report_bad_requests(now)
        interval = self.config.telemetry.interval_s  # read each time: SIGHUP may change it
        if interval and now - self._last_telemetry >= interval:
            late = now - self._last_telemetry > 2 * interval
            self._last_telemetry = now if late else self._last_telemetry + interval
            self._announcer.telemetry(self._telemetry())
        if self._outbox.writer is not None:  # whatever was queued outside a request
            self._outbox.writer.nudge()
        self._expire_sessions()
        if self._metrics is not None and now - self._metrics_pruned >= PRUNE_METRICS_S:
            self._metrics_pruned = now  # removed models' and versions' series
            self._metrics.forget_gone(self._health.models.inventory())
        self._maintain_spool(now)

    def _maintain_spool(self, now: float) -> None:
        """Every few seconds: expire old pending messages (TTL), forget old acknowledged ones."""
        config = self.config
        period = min(5.0, max(0.2, config.resend.window_s / 2))
        if self._spool is None or now - self._spool_maintained < period:
            return
        self._spool_maintained = now
        expired = self._outbox.expire()
        if expired:
            self._counters.add("spool_expired_messages", expired)
            log.warning("spool: %d message(s) older than ttl_s expired unsent", expired)
        history_s = config.mqtt.replay_after_reconnect_s
        if config.resend.enabled:
            history_s = max(history_s, config.resend.window_s)
        self._spool.purge_acked(history_s, config.resend.max_bytes)

    def _tick_s(self) -> float:
        """Fast until READY went out, then often enough for the watchdog pings."""
        if self._reporter.notifier.enabled and not self._reporter.ready_sent:
            return 0.1
        ping = self._reporter.ping_interval_s
        return 0.5 if ping is None else max(0.02, min(0.5, ping / 2))


def _box_monitor(
    config: AgentConfig, metrics: AgentMetrics | None, announcer: Announcer
) -> BoxMonitor | None:
    """The box sampler (agent.ops.box) on the agent's registry; None with `box_interval_s = 0`
    (nothing read, no thread, no `box` key, no energy per inference)."""
    settings = config.telemetry
    if metrics is None or settings.box_interval_s <= 0:
        return None
    box = BoxMonitor(
        interval_s=settings.box_interval_s,
        root=settings.box_root,
        energy=metrics.energy,
        on_event=announcer.event,
    )
    metrics.registry.register(box)
    return box
