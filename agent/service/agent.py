"""Wiring and lifecycle of the daemon: who is made with what, the start and the stop order.

The request path, and who hands what to whom::

    Transport (mqtt-io) --Incoming--> Ingress: read -> check -> store -> submit
        --Job--> Scheduler (infer-worker-N) --> Runner --> ReplyStream
        --messages--> ReplySender --> Outbox (spooled by spool-writer) --> Transport

Start: models are loaded (so the first request finds a warm session), stored requests that
never got their terminal message are queued again, then the workers, the connection, the
housekeeping thread, the watcher and the local sources. Stop: refuse new requests, let
running ones finish within the drain timeout (then cancel them with `shutting_down`),
publish `offline`, flush, disconnect, and only then close the model sessions.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Any

from agent import __version__
from agent.config import AgentConfig
from agent.config.state_files import private_dir
from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.resend import Resender
from agent.delivery.spool import Spool
from agent.delivery.spool_items import AfterWrite
from agent.inference.job import Job
from agent.inference.reply_stream import ReplySender
from agent.inference.runner import Runner
from agent.inference.scheduler import Scheduler
from agent.inference.short_runs import ShortRuns
from agent.models.backends.base import BackendOptions
from agent.models.manager import ModelManager, summarize
from agent.models.watcher import RepositoryWatcher
from agent.mqtt.connection import Transport
from agent.mqtt.epoch import EpochStore
from agent.mqtt.messages import correlation_properties
from agent.ops import logs
from agent.ops.counters import Counters
from agent.ops.endpoint import MetricsServer
from agent.ops.metrics import AgentMetrics
from agent.ops.systemd import Notifier, ServiceReporter
from agent.service.announce import Announcer
from agent.service.connection_hooks import ConnectionHooks
from agent.service.crash_replay import CrashReplay
from agent.service.health import Health
from agent.service.housekeeping import Housekeeping
from agent.service.ingress import Ingress, RequestReader
from agent.service.packet_sizing import share_packet_limit
from agent.service.reload import ReloadReport, plan_reload
from agent.sources import SourceJob, SourceManager

log = logging.getLogger(__name__)

# After the drain timeout cancels the running requests (each ends at its next run of the
# model), how long their current runs may take before they are answered `shutting_down`.
CANCEL_GRACE_S = 5.0


def intra_op_threads(config: AgentConfig) -> int:
    """Threads per ONNX Runtime session so that workers x threads <= cores."""
    if config.models.intra_op_threads:
        return config.models.intra_op_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // config.scheduler.workers)


class Agent:
    """The daemon. `start()`, `wait_ready()`, then `stop()`; `run_forever()` for the CLI."""

    def __init__(self, config: AgentConfig, notifier: Notifier | None = None) -> None:
        """`notifier`: sd_notify target (the CLI passes `$NOTIFY_SOCKET`'s); None: silent."""
        self.config = config
        self.root = config.root_topic
        self.counters = Counters()
        self._stop = threading.Event()
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.reporter = ServiceReporter(
            notifier if notifier is not None and config.systemd.notify else Notifier.disabled()
        )
        private_dir(config.state_dir)  # 0700, whatever the umask (agent.config.state_files)
        self.spool = _open_spool(config)
        self.epoch_store = EpochStore(config.state_dir / "epoch")
        self.outbox = Outbox(
            config.outbox.max_messages,
            config.outbox.error_reserve,
            spool=self.spool,
            on_eviction=lambda eviction: self.announcer.spool_overflow(eviction),
            make_properties=correlation_properties,
            max_bytes=config.outbox.max_bytes,
            background_bytes=config.resend.max_queued_bytes,
        )
        self.models = ModelManager.for_config(
            config.models,
            BackendOptions(
                intra_op_threads=intra_op_threads(config),
                providers=tuple(config.models.providers),
                extra=dict(config.models.backend_options),
            ),
            on_event=self.publish_event,
            on_inventory=lambda: self.hooks.publish_inventory(),
        )
        self.metrics = AgentMetrics(
            lambda: self.health.gauges(),
            device=config.device_id,
            version=__version__,
            known_model=self.models.has_model,
        )
        self.announcer = Announcer(
            config, self.outbox, counters=self.counters, metrics=self.metrics, started_at=started_at
        )
        self.hooks = ConnectionHooks(
            config,
            outbox=self.outbox,
            announcer=self.announcer,
            models=self.models,
            counters=self.counters,
            publish_event=self.publish_event,
            connected=lambda: self.transport.connected.is_set(),
            replay=lambda: self.crash_replay(),
        )
        self.resender = self._make_resender()
        self.watcher = RepositoryWatcher(
            config.models.repository,
            self.models,
            mode=config.models.watch,
            debounce_s=config.models.debounce_s,
            poll_interval_s=config.models.poll_interval_s,
            rescan_s=config.models.rescan_s,
        )
        # The request path, in its order.
        self.sender = ReplySender(self.outbox, self.metrics, self.counters)
        self.short_runs = ShortRuns(config.scheduler.inline_max_ms / 1000.0)
        self.runner = Runner(
            self.models,
            self.sender,
            counters=self.counters,
            metrics=self.metrics,
            short_runs=self.short_runs,
        )
        self.scheduler: Scheduler[Job | SourceJob] = Scheduler(
            workers=config.scheduler.workers,
            queue_size=config.scheduler.queue_size,
            execute=lambda job, queued: self._execute([(job, queued)]),
            expire=self._expired,
            cancel=self._cancelled,
            execute_batch=self._execute,
        )
        self.reader = RequestReader(config, self.models)  # holds the shared packet limit
        self.ingress = Ingress(
            self.reader,
            scheduler=self.scheduler,
            sender=self.sender,
            short_runs=self.short_runs,
            spool=self.spool,
            writer=self.outbox.writer,
            resender=self.resender,
            announcer=self.announcer,
            counters=self.counters,
            metrics=self.metrics,
        )
        self.crash_replay = CrashReplay(self.spool, self.ingress)
        self.transport = self._make_transport()
        self.ingress.connection = self.transport
        self.transport.add_ack_listener(self.metrics.ack.observe)
        self.health = Health(
            config=config,
            scheduler=self.scheduler,
            outbox=self.outbox,
            spool=self.spool,
            transport=self.transport,
            models=self.models,
            reporter=self.reporter,
            counters=self.counters,
            layouts=self.reader.layouts,
            stopping=self._stop,
        )
        self.metrics_server: MetricsServer | None = None
        # Local sources ([[sources]]): the box's own frames, through the same workers.
        self.sources = SourceManager(
            config,
            models=self.models,
            submit=self.scheduler.submit,
            sender=self.sender,
            on_event=self.publish_event,
            limits=self.reader.limits,
            waiting=lambda: self.scheduler.depth,
            registry=self.metrics.registry,
            after_written=self._after_written,
        )
        share_packet_limit(self.reader.packet_limit, self.sources)
        self.housekeeping = Housekeeping(
            config,
            stop=self._stop,
            announcer=self.announcer,
            outbox=self.outbox,
            spool=self.spool,
            counters=self.counters,
            reporter=self.reporter,
            health=self.health,
            telemetry=self.telemetry,
            metrics=self.metrics,
            expire_sessions=self.runner.scan_sessions.expire,
        )

    def _make_resender(self) -> Resender | None:
        if self.spool is None or not self.config.resend.enabled:
            return None
        resend = self.config.resend

        def put(message: OutMessage) -> bool:
            if self.outbox.put_background(message):
                return True
            self.counters.add("resend_dropped_outbox_full")
            return False

        return Resender(
            self.spool,
            put,
            correlation_properties,
            requests_per_s=resend.requests_per_s,
            messages_per_s=resend.messages_per_s,
            bytes_per_s=resend.bytes_per_s,
            gone_qos=self.config.mqtt.qos.reply,
            defer=self._after_written,
        )

    def _make_transport(self) -> Transport:
        config = self.config
        return Transport(
            config.mqtt,
            client_id=config.client_id,
            outbox=self.outbox,
            on_message=self.ingress.on_message,
            subscriptions=[
                (f"{self.root}/infer/+", config.mqtt.qos.request_subscription),
                *([(f"{self.root}/resend", 1)] if self.resender is not None else []),
                (f"{self.root}/cancel", 1),
            ],
            will=lambda epoch: self.announcer.status_message("offline", epoch),
            on_connected=self.hooks.on_connected,
            on_tick=self.hooks.retry_replay,
            on_new_session=self.hooks.on_new_session,
            epoch=self.epoch_store,
            on_publish_refused=self.hooks.publish_refused,
            on_session_lost=self.hooks.session_lost,
            packet_limit=self.reader.packet_limit,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        private_dir(self.config.state_dir)
        self.outbox.start()  # the spool writer
        # A corrupt spool moved aside, an unreadable epoch file: events for the first connection.
        self.announcer.state_recovered(
            self.spool.quarantine if self.spool is not None else None, self.epoch_store.recovery
        )
        self._start_metrics_server()
        self.reporter.notifier.status("loading models")
        if self.config.models.repository.is_dir():
            # Watched before the first sync: a version written meanwhile is seen at once.
            self.watcher.start()
        self._load_models()
        self.ingress.accepting = True  # the stored requests run at the first CONNACK (hooks)
        summary = summarize(self.models.inventory())
        log.info("models:\n%s", summary or f"(none found in {self.config.models.repository})")
        self.scheduler.start()
        self.transport.start()
        self.health.started = True
        self.housekeeping.start()
        self.sources.start()  # last: models loaded, workers and the connection up

    def _start_metrics_server(self) -> None:
        """Bind the metrics endpoint; a port in use costs the metrics, never the service."""
        settings = self.config.metrics
        if not settings.enabled:
            return
        try:
            self.metrics_server = MetricsServer(
                self.metrics.registry, settings.host, settings.port, self.health_report
            )
        except OSError as e:
            log.error(
                "metrics: cannot listen on %s:%d: %s (serving without /metrics)",
                settings.host,
                settings.port,
                e.strerror or e,
            )
            return
        self.metrics_server.start()
        log.info("metrics: %s/metrics", self.metrics_server.url)

    def _load_models(self) -> None:
        """Load the repository before serving; wait for files still being written.

        A version written just before the start is loaded once it settled, so the first
        request finds it warm; the wait is bounded, and the watcher takes over after it.
        """
        again = self.models.sync()
        deadline = time.monotonic() + max(5.0, 3 * self.config.models.settle_s)
        while again is not None and time.monotonic() < deadline:
            time.sleep(again)
            again = self.models.sync()

    @property
    def epoch(self) -> int:
        """The current connection's epoch (0 before the first connection)."""
        return self.hooks.epoch

    def wait_ready(self, timeout: float) -> bool:
        """True once the broker is connected and has the agent's subscriptions (`subscribed`
        is set by the SUBACK that follows a CONNACK), so that a request published now arrives
        (models are loaded before `start` returns)."""
        return self.transport.subscribed.wait(timeout)

    def run_forever(self, stop: threading.Event) -> None:
        self.start()
        stop.wait()
        self.stop()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        drain = self.config.scheduler.drain_timeout_s
        log.info("stopping: draining requests (up to %.0f s)", drain)
        running = self.scheduler.busy + self.scheduler.depth
        self.reporter.notifier.stopping(f"stopping: draining {running} request(s)")
        self.ingress.accepting = False
        self._stop.set()
        self.watcher.close()
        self.sources.stop()  # no new frames; a frame being run finishes with the drain
        cancel_timer = threading.Timer(drain, self.runner.cancel_running)
        cancel_timer.name = "drain-timer"
        cancel_timer.start()
        self.scheduler.stop(drain + CANCEL_GRACE_S)
        cancel_timer.cancel()
        abandoned = self.runner.abandon_running()
        if abandoned:
            log.warning(
                "stopping: %d request(s) still in a run of their model after the drain: "
                "answered shutting_down",
                abandoned,
            )
        self.sources.close()  # waiting frames dropped, each stream's exact next seq saved
        self.runner.close()  # the scan sessions' samples and state
        self.housekeeping.join(5.0)
        # Publishes `offline`, flushes, disconnects, then closes the outbox (the spool writer
        # writes what it holds: the last acknowledgements).
        offline = self.announcer.status_message("offline", self.epoch)
        self.transport.close(final=offline, timeout=5.0)
        self.models.close(drain_timeout=1.0)
        tensorrt = sys.modules.get("agent.models.backends.tensorrt")
        if tensorrt is not None:  # the runtime and CUDA context go last, after every engine
            tensorrt.shutdown()
        if self.spool is not None:
            self.spool.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.reporter.notifier.close()
        log.info("stopped")

    # -- the scheduler's callbacks (worker threads) ------------------------------------------

    def _execute(self, batch: list[tuple[Job | SourceJob, float]]) -> None:
        """A job, or the jobs of one batch: requests go to the runner, a local source's
        ticket runs its frames (agent.sources)."""
        try:
            jobs = [(job, queued) for job, queued in batch if isinstance(job, Job)]
            for job, queued in batch:
                if isinstance(job, SourceJob):
                    job.run(queued)
            if jobs:
                self.runner.execute(jobs)
        finally:
            self._nudge_writer()  # the replies are out: now the spool may take its turn

    def _expired(self, job: Job | SourceJob) -> None:
        if isinstance(job, SourceJob):
            job.cancel()  # source tickets carry no deadline
        else:
            self.runner.expire(job)

    def _cancelled(self, job: Job | SourceJob) -> None:
        if isinstance(job, SourceJob):
            job.cancel()
        else:
            self.runner.cancel(job)

    # -- events and the spool writer ---------------------------------------------------------

    def publish_event(self, event: dict[str, Any]) -> None:
        self.announcer.event(event)

    def _after_written(self, callback: Any) -> None:
        """Run `callback` on the spool writer's thread once everything queued so far is on
        disk (at once without a spool)."""
        writer = self.outbox.writer
        if writer is None:
            callback()
        else:
            writer.submit(AfterWrite(lambda spool: callback()))
            writer.nudge()  # someone waits for it (a folder's file, a resend)

    def _nudge_writer(self) -> None:
        if self.outbox.writer is not None:
            self.outbox.writer.nudge()

    # -- health, telemetry, reload -----------------------------------------------------------

    def health_problem(self) -> str | None:
        """None while healthy (agent.service.health)."""
        return self.health.problem()

    def health_report(self) -> tuple[bool, dict[str, Any]]:
        return self.health.report()

    def telemetry(self) -> dict[str, Any]:
        return self.health.telemetry(self.epoch, self.sources, self.metrics)

    def reload(self, new: AgentConfig) -> ReloadReport:
        """Apply what is safe to change while running (agent.service.reload); list the keys
        that need a restart."""
        # RELOADING/READY bracket a reload only after the first READY (never announce early).
        announce = self.reporter.ready_sent
        if announce:
            self.reporter.notifier.reloading("reloading the configuration")
        merged, applied, restart = plan_reload(self.config, new)
        if "log_level" in applied or "log_format" in applied:
            logs.reconfigure(merged.log_level, merged.log_format)
        self.config = self.health.config = self.announcer.config = self.hooks.config = merged
        self.housekeeping.config = merged
        self.reader.reconfigure(merged)
        self.short_runs.max_s = merged.scheduler.inline_max_ms / 1000.0
        report = ReloadReport(applied, restart)
        if restart:
            log.warning(
                "reload: applied %s; needs a restart to take effect: %s",
                ", ".join(applied) or "nothing",
                ", ".join(restart),
            )
        else:
            log.info("reload: applied %s", ", ".join(applied) or "nothing (no change)")
        self.metrics.reloads.labels("restart_needed" if restart else "ok").inc()
        self.publish_event(
            {"type": "config_reloaded", "applied": applied, "restart_required": restart}
        )
        self.health.restart_pending = restart
        status = self.health.status()
        if announce:
            self.reporter.notifier.ready(status)
        else:
            self.reporter.notifier.status(status)
        return report


def _open_spool(config: AgentConfig) -> Spool | None:
    if not config.spool.enabled:
        return None
    assert config.spool.path is not None
    return Spool(
        config.spool.path,
        max_bytes=config.spool.max_bytes,
        max_messages=config.spool.max_messages,
        policy=config.spool.policy,
        ttl_s=config.spool.ttl_s,
    )
