"""How the agent is doing: health for systemd and `/healthz`, the STATUS= line, gauges for
Prometheus and the telemetry snapshot.

Read-only views over the running parts, from any thread (the housekeeping thread, the
metrics server's threads, `ROOT/telemetry`). A broker that is down is not a health problem
(the agent reconnects and spools; a restart would not help); a dead or stuck thread is, and
stops the watchdog pings so that systemd restarts the service.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agent.config import AgentConfig
from agent.delivery.outbox import Outbox
from agent.delivery.spool import Spool
from agent.inference.scheduler import Scheduler
from agent.models.manager import ModelManager
from agent.mqtt.connection import Transport
from agent.ops.box import BoxMonitor
from agent.ops.counters import Counters
from agent.ops.metrics import AgentMetrics, Gauges
from agent.ops.systemd import ServiceReporter
from agent.protocol.layouts import RequestLayouts
from agent.sources import SourceManager


@dataclass
class Health:
    """The parts health and telemetry read; `started`, `restart_pending` and `config` are
    kept current by the agent."""

    config: AgentConfig
    scheduler: Scheduler[Any]
    outbox: Outbox
    spool: Spool | None
    transport: Transport
    models: ModelManager
    reporter: ServiceReporter
    counters: Counters
    layouts: RequestLayouts
    stopping: threading.Event
    started: bool = False
    restart_pending: list[str] = field(default_factory=list)  # keys a SIGHUP could not apply
    box: BoxMonitor | None = None  # the box sampler (agent.service.housekeeping makes it)

    def problem(self) -> str | None:
        """None while healthy: the workers are alive and none is stuck, the MQTT loop runs."""
        if not self.started:
            return "starting"
        stopping = self.stopping.is_set()
        if not self.scheduler.alive and not stopping:
            return "an inference worker thread died"
        writer = self.outbox.writer
        if writer is not None and not writer.alive and not stopping:
            return "the spool writer thread died"
        if self.scheduler.busy:
            age = time.monotonic() - self.scheduler.oldest_heartbeat()
            limit = self.config.systemd.stuck_after_s
            if age > limit:
                return f"an inference worker has run one job for {age:.0f} s (limit {limit:g} s)"
        return None if stopping else self.transport.thread_problem()

    def storage_problem(self) -> str | None:
        """Why the spool cannot be written (a full disk), None while writes succeed. Not a
        `problem()`: a restart would not free the disk, so the watchdog keeps being fed."""
        writer = self.outbox.writer
        return writer.problem if writer is not None else None

    def report(self) -> tuple[bool, dict[str, Any]]:
        """For `/healthz` (and so `edge-agent health`, the container's HEALTHCHECK): not ok
        on a `problem()` and while the spool cannot be written (QoS 1/2 requests then get
        `overloaded`)."""
        problem = self.problem() or self.storage_problem()
        return problem is None, {
            "problem": problem,
            "connected": self.transport.connected.is_set(),
            "status": self.status(),
        }

    def status(self) -> str:
        """The STATUS= line: models and broker, nothing that changes on every request."""
        models = self.models.inventory()["models"]
        serving = sum(1 for m in models.values() if m["serving"] is not None)
        failed = sum(
            1 for m in models.values() for v in m["versions"].values() if v["state"] == "failed"
        )
        text = f"serving {serving} of {len(models)} model(s)"
        if failed:
            text += f", {failed} version(s) failed"
        mqtt = self.config.mqtt
        if self.transport.connected.is_set():
            text += f"; broker {mqtt.host}:{mqtt.port} connected"
        elif self.reporter.ready_sent:
            text += f"; broker {mqtt.host}:{mqtt.port} lost, reconnecting"
        else:
            text += f"; waiting for broker {mqtt.host}:{mqtt.port}"
        if self.restart_pending:
            text += f"; restart needed for {len(self.restart_pending)} changed key(s)"
        storage = self.storage_problem()
        if storage is not None:
            text += f"; spool not writable: {storage}"
        return text

    def gauges(self) -> Gauges:
        """What Prometheus reads at scrape time."""
        spool, busy, transport = self.spool, self.scheduler.busy, self.transport
        return Gauges(
            queue_depth=self.scheduler.depth,
            busy_workers=busy,
            workers=self.config.scheduler.workers,
            outbox_depth=len(self.outbox),
            inflight_publishes=transport.inflight,
            connected=transport.connected.is_set(),
            reconnects=transport.reconnects,
            acked=transport.acked,
            publish_failures=transport.publish_failures,
            spool_messages=spool.count if spool is not None else None,
            spool_bytes=spool.bytes if spool is not None else None,
            spool_evicted=self.counters.get("spool_evicted_messages"),
            healthy=self.problem() is None,
            oldest_job_s=time.monotonic() - self.scheduler.oldest_heartbeat() if busy else 0.0,
            inventory=self.models.inventory(),
            counters=self.counters.snapshot(),
            device_bytes=self.models.device_bytes(),
            prefix_caches=self.models.prefix_caches(),
        )

    def telemetry(
        self, epoch: int, sources: SourceManager, metrics: AgentMetrics
    ) -> dict[str, Any]:
        """Counters and gauges, plus the Prometheus registry as plain data (`metrics`)."""
        counters = self.counters.snapshot()
        if self.layouts.hits:  # counted by the network thread alone, without a lock
            counters["requests_layout_repeats"] = self.layouts.hits
        spool, transport = self.spool, self.transport
        return {
            "ts": time.time_ns(),
            "epoch": epoch,
            "counters": counters,
            "gauges": {
                "queue_depth": self.scheduler.depth,
                "busy_workers": self.scheduler.busy,
                "outbox_depth": len(self.outbox),
                "spool_pending": spool.count if spool else 0,
                "spool_bytes": spool.bytes if spool else 0,
                "inflight_publishes": transport.inflight,
                "reconnects": transport.reconnects,
                "acked": transport.acked,
            },
            **({"sources": sources.snapshot()} if sources else {}),
            **({"box": self.box.telemetry()} if self.box is not None else {}),
            "metrics": metrics.snapshot(),
        }
