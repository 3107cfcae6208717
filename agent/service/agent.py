"""Wiring and lifecycle of the daemon: start order, ingress, execution, stop order.

Start: models are loaded (so the first request finds a warm session), then the MQTT
connection, then the workers. Stop: refuse new requests, let running ones finish within the
drain timeout (then cancel them with `shutting_down`), publish `offline`, flush, disconnect,
and only then close the model sessions.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import BaseModel

from agent import __version__
from agent.config import AgentConfig
from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.resend import Resender, parse_resend
from agent.delivery.spool import AfterWrite, Eviction, Spool, StoreRequest, request_key
from agent.inference import batching, short_runs
from agent.inference.scheduler import BatchSpec, Scheduler
from agent.inference.short_runs import ShortRuns
from agent.inference.streaming import (
    CancelFlag,
    Cancelled,
    Execution,
    ReplyStream,
    initial_state,
    max_steps,
    merge_pieces,
)
from agent.models.backends.base import BackendOptions, InferenceError, TensorSpec
from agent.models.manager import LoadedVersion, ModelManager, Serving, summarize
from agent.models.watcher import RepositoryWatcher
from agent.mqtt.transport import EpochStore, Incoming, Transport
from agent.ops import logs
from agent.ops.metrics import AgentMetrics, Gauges, MetricsServer
from agent.ops.systemd import Notifier, ServiceReporter
from agent.protocol import wire
from agent.protocol.layouts import RequestLayouts
from agent.sources import SourceJob, SourceManager

log = logging.getLogger(__name__)

# Bad input with no readable id is reported on `events` at most this often, with a count.
BAD_REQUEST_REPORT_S = 1.0


@dataclass(eq=False)  # identity, so jobs can sit in a set
class Job:
    request: wire.Request
    reply: ReplyStream
    received: float  # monotonic
    cancelled: CancelFlag = field(default_factory=CancelFlag)
    # The inputs as checked at ingress against this version: no second check if it runs on it.
    checked: tuple[int, dict[str, Any]] | None = None
    payload_bytes: int = 0  # the request's size on the wire


@functools.lru_cache(maxsize=256)
def _shared_batch_spec(
    model: str, version: int | None, rows: int, max_batch: int, delay_us: int
) -> BatchSpec:
    """One (immutable) spec per kind of request, not one per request: making the frozen
    dataclass cost 1.4 µs, on the network thread, for each request of a batched model."""
    return BatchSpec((model, version), rows, max_batch, delay_us / 1e6)


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
        self._infer_prefix = f"{self.root}/infer/"  # every request's topic starts with it
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.limits = _limits(config)
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._bad_unreported = 0
        self._bad_last_reason = ""
        self._bad_last_report = 0.0
        self._accepting = False
        self._layouts = RequestLayouts()  # the network thread's only
        self._stop = threading.Event()
        self._running: set[Job] = set()
        self._running_lock = threading.Lock()
        self.epoch = 0
        self.spool: Spool | None = None
        self._spool_maintained = 0.0
        if config.spool.enabled:
            assert config.spool.path is not None
            self.spool = Spool(
                config.spool.path,
                max_bytes=config.spool.max_bytes,
                max_messages=config.spool.max_messages,
                policy=config.spool.policy,
                ttl_s=config.spool.ttl_s,
            )
        self.resender: Resender | None = None
        if self.spool is not None and config.resend.enabled:
            self.resender = Resender(
                self.spool,
                self._resend_nowait,
                _correlation_properties,
                requests_per_s=config.resend.requests_per_s,
                messages_per_s=config.resend.messages_per_s,
                gone_qos=config.mqtt.qos.reply,
                defer=self._after_written,
            )
        self.outbox = Outbox(
            config.outbox.max_messages,
            config.outbox.error_reserve,
            spool=self.spool,
            on_eviction=self._on_eviction,
            make_properties=_correlation_properties,
        )
        self.models = ModelManager(
            config.models.repository,
            BackendOptions(
                intra_op_threads=intra_op_threads(config),
                providers=tuple(config.models.providers),
                extra=dict(config.models.backend_options),
            ),
            warmup=config.models.warmup,
            on_event=self.publish_event,
            on_inventory=self._publish_inventory,
            settle_s=config.models.settle_s,
            drain_timeout_s=config.models.drain_timeout_s,
        )
        self.watcher = RepositoryWatcher(
            config.models.repository,
            self.models,
            mode=config.models.watch,
            debounce_s=config.models.debounce_s,
            poll_interval_s=config.models.poll_interval_s,
            rescan_s=config.models.rescan_s,
        )
        self.short_runs = ShortRuns(config.scheduler.inline_max_ms / 1000.0)
        self.scheduler: Scheduler[Job | SourceJob] = Scheduler(
            workers=config.scheduler.workers,
            queue_size=config.scheduler.queue_size,
            execute=self._execute,
            expire=self._expired,
            cancel=self._cancelled,
            execute_batch=self._execute_batch,
        )
        qos = config.mqtt.qos
        self.transport = Transport(
            config.mqtt,
            client_id=config.client_id,
            outbox=self.outbox,
            on_message=self._on_message,
            subscriptions=[
                (f"{self.root}/infer/+", qos.request_subscription),
                *([(f"{self.root}/resend", 1)] if self.resender is not None else []),
            ],
            will=lambda epoch: self._status_message("offline", epoch),
            on_connected=self._on_connected,
            on_new_session=self._on_new_session,
            epoch=EpochStore(config.state_dir / "epoch"),
        )
        self._housekeeping = threading.Thread(
            target=self._housekeep, name="housekeeping", daemon=True
        )
        self._started = False
        self._restart_pending: list[str] = []  # changed keys a SIGHUP could not apply
        self.reporter = ServiceReporter(
            notifier if notifier is not None and config.systemd.notify else Notifier.disabled()
        )
        self.metrics = AgentMetrics(
            self._gauges,
            device=config.device_id,
            version=__version__,
            known_model=self.models.has_model,
        )
        self.transport.add_ack_listener(self.metrics.ack.observe)
        self.metrics_server: MetricsServer | None = None
        # Local sources ([[sources]]): the box's own frames, through the same workers.
        self.sources = SourceManager(
            config,
            models=self.models,
            submit=self.scheduler.submit,
            send=self._send_blocking,
            on_event=self.publish_event,
            limits=self.limits,
            waiting=lambda: self.scheduler.depth,
            registry=self.metrics.registry,
            after_written=self._after_written,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self.outbox.start()  # the spool writer: stored requests replayed below queue on it
        self._start_metrics_server()
        self.reporter.notifier.status("loading models")
        self._load_models()
        self._replay_stored_requests()
        summary = summarize(self.models.inventory())
        log.info("models:\n%s", summary or f"(none found in {self.config.models.repository})")
        self._accepting = True
        self.scheduler.start()
        self.transport.start()
        self._started = True
        self._housekeeping.start()
        if self.config.models.repository.is_dir():
            self.watcher.start()
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

    def _replay_stored_requests(self) -> None:
        """Requests stored before a crash that never got their terminal message run again.

        Their partial streams are dropped from the spool first, so each runs from seq 0 once
        more; a subscriber drops what it already had by (id, seq).
        """
        if self.spool is None:
            return
        stored = self.spool.unfinished_requests()
        for request in stored:
            self.spool.drop_stream(request.key)
        if stored:
            log.info("replaying %d stored request(s) that had no terminal message", len(stored))
        self._accepting = True
        for request in stored:
            incoming = Incoming(
                request.topic,
                request.payload,
                request.qos,
                request.response_topic,
                request.correlation,
            )
            self._on_message(incoming, replay=True)

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

    def wait_ready(self, timeout: float) -> bool:
        """True once the broker is connected (models are loaded before `start` returns)."""
        return self.transport.connected.wait(timeout)

    def run_forever(self, stop: threading.Event) -> None:
        self.start()
        stop.wait()
        self.stop()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        log.info(
            "stopping: draining requests (up to %.0f s)", self.config.scheduler.drain_timeout_s
        )
        running = self.scheduler.busy + self.scheduler.depth
        self.reporter.notifier.stopping(f"stopping: draining {running} request(s)")
        self._accepting = False
        self._stop.set()
        self.watcher.close()
        self.sources.stop()  # no new frames; a frame being run finishes with the drain
        drain = self.config.scheduler.drain_timeout_s
        cancel_timer = threading.Timer(drain, self._cancel_running)
        cancel_timer.name = "drain-timer"
        cancel_timer.start()
        self.scheduler.stop(drain + 5.0)
        cancel_timer.cancel()
        self.sources.close()  # waiting frames dropped, each stream's exact next seq saved
        if self._housekeeping.is_alive():
            self._housekeeping.join(5.0)
        # Publishes `offline`, flushes, disconnects, then closes the outbox (the spool writer
        # writes what it holds: the last acknowledgements).
        self.transport.close(final=self._status_message("offline", self.epoch), timeout=5.0)
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

    def _cancel_running(self) -> None:
        with self._running_lock:
            for job in self._running:
                job.cancelled.set()

    # -- outgoing helpers ----------------------------------------------------------------------

    def _status_message(self, state: str, epoch: int) -> OutMessage:
        payload = {
            "state": state,
            "agent_version": __version__,
            "device": self.config.device_id,
            "started_at": self.started_at,
            "epoch": epoch,
        }
        return OutMessage(
            f"{self.root}/status", wire.encode_payload(payload), self.config.mqtt.qos.status, True
        )

    def _inventory_message(self) -> OutMessage:
        return OutMessage(
            f"{self.root}/models",
            wire.encode_payload(self.models.inventory()),
            self.config.mqtt.qos.status,
            True,
        )

    def _on_connected(self, epoch: int) -> None:
        """Runs on paho's thread: birth message and inventory go out before anything queued."""
        self.epoch = epoch
        self.outbox.unget(self._inventory_message())
        self.outbox.unget(self._status_message("online", epoch))

    def _on_new_session(self, lost_at: float | None) -> None:
        """Before a new connection: what was in flight goes out again from the spool, and so
        does what the broker acknowledged just before the connection was lost (it may have
        crashed before saving it)."""
        window = self.config.mqtt.replay_after_reconnect_s
        since = None if lost_at is None or window <= 0 else lost_at - window
        pending = self.outbox.rewind(unack_since=since)
        if pending:
            log.info("mqtt: %d spooled message(s) to publish on the new connection", pending)

    def _publish_inventory(self) -> None:
        # While disconnected nothing is queued: the next connection publishes the current one.
        if self.transport.connected.is_set():
            self.outbox.put_nowait_reserved(self._inventory_message())

    def publish_event(self, event: dict[str, Any]) -> None:
        body = {"type": event["type"], "ts": time.time_ns(), **event}
        message = OutMessage(
            f"{self.root}/events",
            wire.encode_payload(body),
            self.config.mqtt.qos.event,
            stream="events",
        )
        if not self.outbox.put_nowait_reserved(message):
            self.count("events_dropped")
        if event["type"] == "model_loaded" and isinstance(event.get("load_s"), float | int):
            self.metrics.model_loaded(str(event.get("model")), float(event["load_s"]))

    def count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += n

    # -- ingress (paho's thread: must never block) -----------------------------------------------

    def _on_eviction(self, eviction: Eviction) -> None:
        """drop_oldest made room: say which streams lost their pending messages."""
        self.count("spool_evicted_messages", eviction.messages)
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
        # Not spooled itself: it is about the spool having no room.
        self.outbox.put_nowait_reserved(
            OutMessage(f"{self.root}/events", wire.encode_payload(body), self.config.mqtt.qos.event)
        )

    def _on_message(self, incoming: Incoming, replay: bool = False) -> None:
        prefix = self._infer_prefix
        if incoming.topic.startswith(prefix):
            self._on_request(incoming.topic[len(prefix) :], incoming, replay)
        elif incoming.topic == f"{self.root}/resend" and self.resender is not None:
            self._on_resend(incoming)

    def _on_resend(self, incoming: Incoming) -> None:
        """Validated and rate-limited like any outside input; bad ones are only counted."""
        assert self.resender is not None
        self.count("resend_received")
        try:
            payload = wire.decode_payload(incoming.payload, self.limits)
            request = parse_resend(
                payload, root=self.root, allowed_prefixes=self.config.reply_prefixes
            )
        except wire.WireError as e:
            self._note_bad_request(f"resend: {e.message}")
            return
        self.resender.handle(request)

    def _reply_stream(
        self,
        request_id: str,
        model: str,
        version: int | None,
        reply_to: str | None,
        qos: int | None,
        correlation: bytes | None,
        send: Callable[[OutMessage], None],
    ) -> ReplyStream:
        properties = None
        if correlation is not None and self.transport.mqtt5:
            properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            properties.CorrelationData = correlation
        return ReplyStream(
            request_id=request_id,
            model=model,
            version=version,  # type: ignore[arg-type]  # set to the leased version later
            topic=reply_to or f"{self.root}/result/{model}/{request_id}",
            qos=self.config.mqtt.qos.reply if qos is None else qos,
            max_chunk_bytes=self.config.limits.max_chunk_bytes,
            send=send,
            properties=properties,
            correlation=correlation,
            stream_key=request_key(model, request_id),
        )

    def _reject(
        self, incoming: Incoming, model: str, payload: dict[str, Any] | None, error: wire.WireError
    ) -> None:
        """Answer a request that cannot be queued; requests without a readable id are counted."""
        request_id = error.request_id or (wire.read_request_id(payload) if payload else None)
        self.count(f"rejected_{error.code}")
        self.metrics.request_done(model, None, error.code)
        if request_id is None:
            self._note_bad_request(error.message)
            return
        reply_to = None
        if payload is not None:
            candidate = payload.get("reply_to", incoming.response_topic)
            if isinstance(candidate, str) and self._reply_allowed(candidate):
                reply_to = candidate
        qos = payload.get("qos") if payload is not None else None
        stream = self._reply_stream(
            request_id,
            model,
            None,
            reply_to,
            qos if qos in (0, 1, 2) and not isinstance(qos, bool) else None,
            incoming.correlation_data,
            self._send_nowait,
        )
        stream.error(error.code, error.message)

    def _after_written(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the spool writer's thread once everything queued so far is on
        disk (at once without a spool)."""
        writer = self.outbox.writer
        if writer is None:
            callback()
        else:
            writer.submit(AfterWrite(lambda spool: callback()))
            writer.nudge()  # someone waits for it (a folder's file, a resend)

    def _reply_allowed(self, topic: str) -> bool:
        return (
            len(topic) <= 256
            and not any(c in topic for c in "+#\0")
            and any(topic.startswith(p) for p in self.config.reply_prefixes)
        )

    def _resend_nowait(self, message: OutMessage) -> bool:
        if self.outbox.put_background(message):
            return True
        self.count("resend_dropped_outbox_full")
        return False

    def _send_nowait(self, message: OutMessage) -> None:
        if not self.outbox.put_nowait_reserved(message):
            self.count("replies_dropped_outbox_full")
            log.error("outbox full: an error reply to %s could not be queued", message.topic[:200])
            return
        self.metrics.reply_sent(len(message.payload))

    def _note_bad_request(self, reason: str) -> None:
        now = time.monotonic()
        with self._counter_lock:
            self._bad_unreported += 1
            self._bad_last_reason = reason
            due = now - self._bad_last_report >= BAD_REQUEST_REPORT_S
        if due:
            self._report_bad_requests()

    def _report_bad_requests(self) -> None:
        with self._counter_lock:
            count, self._bad_unreported = self._bad_unreported, 0
            reason = self._bad_last_reason
            if count:
                self._bad_last_report = time.monotonic()
        if count:
            self.publish_event({"type": "bad_request", "count": count, "reason": reason[:300]})

    def _on_request(self, model: str, incoming: Incoming, replay: bool = False) -> None:
        self.count("requests_received")
        self.metrics.received.inc()
        payload: dict[str, Any] | None = None
        prefixes, response_topic = self.config.reply_prefixes, incoming.response_topic
        # A repeat of a layout of the model's requests needs no decoding (request_layouts).
        request = self._layouts.parse(
            incoming.payload, model, self.limits, prefixes, response_topic
        )
        try:
            if request is None:
                payload = wire.decode_payload(incoming.payload, self.limits)
                if response_topic is not None and "reply_to" not in payload:
                    payload = {**payload, "reply_to": response_topic}
                request = wire.parse_request(
                    payload, model, self.limits, allowed_reply_prefixes=prefixes
                )
            request.correlation_data = incoming.correlation_data
            if not self._accepting:
                raise wire.WireError("shutting_down", "the agent is stopping", request.id)
            serving, checked = self._precheck(request)
        except wire.WireError as e:
            self._reject(incoming, model, payload, e)
            return
        if payload is not None:
            self._layouts.learn(
                incoming.payload, payload, request, self.limits, prefixes, response_topic
            )
        job = Job(
            request,
            self._reply_stream(
                request.id,
                model,
                request.version,
                request.reply_to,
                request.qos,
                request.correlation_data,
                self._send_blocking,
            ),
            time.monotonic(),
            checked=checked,
            payload_bytes=len(incoming.payload),
        )
        if self.spool is not None and incoming.qos > 0:
            key = request_key(model, request.id)
            if not replay and not self._store(key, incoming):
                self.count("requests_duplicate")
                return  # a redelivery of a request that is already stored and running
            job.reply.request_key = key
        deadline = None if request.deadline_ms is None else request.deadline_ms / 1000.0
        batch = self._batch_spec(request, serving)
        short = batch is None and not replay and self._short(request, serving, job.payload_bytes)
        if short and self.scheduler.run_here(job):
            self.count("requests_inline")  # it ran here, on the network thread: no hand-off
            return
        if not self.scheduler.submit(job, request.priority, deadline, batch):
            self.count("rejected_overloaded")
            self.metrics.request_done(model, None, "overloaded")
            job.reply.send = self._send_nowait
            job.reply.error("overloaded", "the request queue is full; retry later")

    @staticmethod
    def _batch_spec(request: wire.Request, serving: Serving) -> BatchSpec | None:
        """How the request may share a run with others (its model's `[batching]`)."""
        config = serving.batching
        if config is None:
            return None
        rows = batching.leading_rows(request.inputs)
        if rows is None or rows >= config.max_batch:
            return None  # nothing to join (or no room for another request)
        return _shared_batch_spec(
            request.model, request.version, rows, config.max_batch, config.max_queue_delay_us
        )

    def _short(self, request: wire.Request, serving: Serving, payload_bytes: int) -> bool:
        """Whether the request may run on this, the network thread
        (agent.inference.short_runs): not a `steps` model (whose run count the request
        chooses), expected to be short, and room in the outbox for what it sends (this thread
        could not wait for room: only it makes some)."""
        version = serving.version if request.version is None else request.version
        return (
            serving.stream.mode != "steps"
            and self.short_runs.is_short(request.model, version, payload_bytes)
            and self.outbox.has_room(
                short_runs.MAX_MESSAGES,
                # A message's payload, and generously its topic, ids and correlation data.
                self.config.limits.max_chunk_bytes + 4096,
            )
        )

    def _store(self, key: str, incoming: Incoming) -> bool:
        """Queue the request for the spool writer; the broker gets its acknowledgement once
        it is fsynced (the job runs meanwhile). False for a redelivery of a stored request:
        that one is acknowledged once the original is stored."""
        assert self.spool is not None and self.outbox.writer is not None
        # Called by the spool writer, which has the acknowledgements of a batch sent together.
        ack = self.transport.defer(incoming)
        if key in self.spool.request_keys:
            self.outbox.writer.submit(AfterWrite(lambda spool: ack()))
            return False
        self.spool.request_keys.add(key)
        self.outbox.writer.submit(
            StoreRequest(
                key,
                incoming.topic,
                incoming.payload,
                incoming.qos,
                incoming.response_topic,
                incoming.correlation_data,
                on_stored=ack,
            )
        )
        return True

    def _precheck(self, request: wire.Request) -> tuple[Serving, tuple[int, dict[str, Any]] | None]:
        """Cheap checks against the serving version, so junk never takes a queue slot; the
        checked inputs come back for a worker that leases that same version."""
        serving = self.models.serving(request.model)
        if serving is None:
            if not self.models.has_model(request.model):
                message = f"no model named '{request.model}'"
            else:
                message = f"model '{request.model}' has no ready version"
            raise wire.WireError("unknown_model", message, request.id)
        if request.version is not None:
            return serving, None  # a pinned version is checked when it is leased
        specs = _required(serving.inputs, serving.stream.state, request.inputs)
        return serving, (serving.version, wire.validate_inputs(request.id, request.inputs, specs))

    def _send_blocking(self, message: OutMessage) -> None:
        self.outbox.put(message)
        self.metrics.reply_sent(len(message.payload))

    # -- execution (worker threads) ----------------------------------------------------------

    def _finish_error(self, job: Job, code: str, message: str) -> None:
        self.count(f"requests_{code}")
        if job.reply.error(code, message):
            version = job.reply.version if isinstance(job.reply.version, int) else None
            self.metrics.request_done(job.request.model, version, code)

    def _expired(self, job: Job | SourceJob) -> None:
        if isinstance(job, SourceJob):
            job.cancel()  # source tickets carry no deadline
        else:
            self._finish_error(job, "deadline_exceeded", "not started within deadline_ms")

    def _cancelled(self, job: Job | SourceJob) -> None:
        if isinstance(job, SourceJob):
            job.cancel()
        else:
            self._finish_error(job, "shutting_down", "the agent is stopping")

    def _execute(self, job: Job | SourceJob, queued_s: float) -> None:
        try:
            if isinstance(job, SourceJob):
                job.run(queued_s)  # a local source's frame (agent.sources)
            else:
                started = time.monotonic()
                self._run_request(job, queued_s)
                reply = job.reply
                if isinstance(reply.version, int):  # it leased a version
                    self.short_runs.record(
                        job.request.model,
                        reply.version,
                        time.monotonic() - started,
                        reply.seq,
                        job.payload_bytes,
                    )
        finally:
            self._nudge_writer()  # the replies are out: now the spool may take its turn

    def _nudge_writer(self) -> None:
        if self.outbox.writer is not None:
            self.outbox.writer.nudge()

    def _run_request(self, job: Job, queued_s: float) -> None:
        request, reply = job.request, job.reply
        with self._running_lock:
            self._running.add(job)
        try:
            with self.models.lease(request.model, request.version) as lease:
                loaded = lease.loaded
                reply.version = loaded.version
                stream_config = loaded.config.stream
                inputs = self._checked_inputs(job, loaded)
                inputs = initial_state(loaded.session, stream_config, inputs)
                execution = Execution(
                    loaded.session, stream_config, inputs, request.params, job.cancelled
                )
                if request.stream:
                    first = True
                    for index, outputs in execution.pieces():
                        reply.chunk(outputs, index)
                        if first:
                            first = False
                            since = time.monotonic() - job.received
                            self.metrics.first_chunk_after(request.model, since)
                    reply.end(self._timing(job, queued_s, execution.stats.infer_s))
                else:
                    merged = merge_pieces(stream_config.mode, list(execution.pieces()))
                    reply.result(merged, self._timing(job, queued_s, execution.stats.infer_s))
            self.count("requests_ok")
            self._record_ok(job, queued_s, execution.stats.infer_s)
        except wire.WireError as e:
            self._finish_error(job, e.code, e.message)
        except InferenceError as e:
            self._finish_error(job, "model_error", str(e))
        except Cancelled:
            self._finish_error(
                job, "shutting_down", "the agent stopped before the request finished"
            )
        except Exception as e:
            log.exception("request %s failed", request.id)
            self._finish_error(job, "model_error", f"{type(e).__name__}: {e}")
        finally:
            with self._running_lock:
                self._running.discard(job)

    def _execute_batch(self, batch: list[tuple[Job | SourceJob, float]]) -> None:
        """Requests of one model (and pinned version) that were queued together: one lease,
        each checked on its own, then run in groups whose inputs can be joined."""
        jobs = [(job, queued) for job, queued in batch if isinstance(job, Job)]
        for job, queued in batch:
            if isinstance(job, SourceJob):  # never batched; here only if that ever changed
                job.run(queued)
        if not jobs:
            return
        first = jobs[0][0].request
        with self._running_lock:
            self._running.update(job for job, _ in jobs)
        try:
            with self.models.lease(first.model, first.version) as lease:
                loaded = lease.loaded
                members: list[batching.Member] = []
                ready: list[tuple[Job, float]] = []
                for job, queued in jobs:
                    member = self._member(job, loaded)
                    if member is not None:
                        members.append(member)
                        ready.append((job, queued))
                for group in batching.groups(members):
                    self._run_group(loaded, [members[i] for i in group], [ready[i] for i in group])
        except wire.WireError as e:  # the lease: the model or version went away meanwhile
            for job, _ in jobs:
                self._finish_error(job, e.code, e.message)
        finally:
            with self._running_lock:
                self._running.difference_update(job for job, _ in jobs)
            self._nudge_writer()

    @staticmethod
    def _checked_inputs(job: Job, loaded: LoadedVersion) -> dict[str, Any]:
        """The request's inputs checked against the leased version (once: at ingress when it
        is the version checked there)."""
        request = job.request
        if job.checked is not None and job.checked[0] == loaded.version:
            return job.checked[1]
        specs = _required(loaded.session.inputs, loaded.config.stream.state, request.inputs)
        return wire.validate_inputs(request.id, request.inputs, specs)

    def _member(self, job: Job, loaded: LoadedVersion) -> batching.Member | None:
        """The request's inputs checked against the leased version (an error answers it)."""
        request, config = job.request, loaded.config.stream
        job.reply.version = loaded.version
        try:
            inputs = self._checked_inputs(job, loaded)
            inputs = initial_state(loaded.session, config, inputs)
            return batching.Member(inputs, max_steps(config, request.params), job.cancelled)
        except wire.WireError as e:
            self._finish_error(job, e.code, e.message)
            return None

    def _run_group(
        self, loaded: LoadedVersion, members: list[batching.Member], jobs: list[tuple[Job, float]]
    ) -> None:
        """One batched run; each request streams (or collects) its own pieces. A run's
        replies are queued together (one round of the outbox's lock) and published with one
        write; the requests it finished are counted together too."""
        config = loaded.config.stream
        replies: list[OutMessage] = []
        done: list[tuple[Job, float, float]] = []  # (job, queued, total) of finished requests

        def publish() -> None:  # after each run: what it finished, then its replies
            if done:  # counted before the replies can reach anyone
                finished_now = done.copy()
                done.clear()
                self._record_ok_batch(loaded, finished_now, run.infer_s)
            if replies:
                batch = replies.copy()
                replies.clear()  # taken even if the outbox refuses them (closed): never twice
                self.outbox.put_many(batch)
                self.metrics.reply_sent(sum(len(m.payload) for m in batch), len(batch))
            self.outbox.kick()

        run = batching.BatchRun(loaded.session, config, members, after_run=publish)
        for job, _ in jobs:
            job.reply.send = replies.append
        collected: dict[int, list[tuple[int, dict[str, Any]]]] = {}
        whole = config.mode == "whole"
        finished: set[int] = set()
        self.metrics.batch_run(loaded.model, len(members))
        try:
            for index, piece, outputs, last in run.pieces():
                job, queued = jobs[index]
                reply = job.reply
                if job.request.stream:
                    reply.chunk(outputs, piece)
                    if piece == 0:
                        since = time.monotonic() - job.received
                        self.metrics.first_chunk_after(job.request.model, since)
                    if last:
                        reply.end(self._timing(job, queued, run.infer_s))
                elif whole:  # one piece per request: the result itself
                    reply.result(outputs, self._timing(job, queued, run.infer_s))
                else:
                    collected.setdefault(index, []).append((piece, outputs))
                    if last:
                        merged = merge_pieces(config.mode, collected.pop(index))
                        reply.result(merged, self._timing(job, queued, run.infer_s))
                if last:
                    finished.add(index)
                    done.append((job, queued, time.monotonic() - job.received))
        except InferenceError as e:
            failure: tuple[str, str] | None = ("model_error", str(e))
        except Exception as e:
            log.exception("batch of %d request(s) to %s failed", len(members), loaded.model)
            failure = ("model_error", f"{type(e).__name__}: {e}")
        else:
            failure = None
        publish()  # what a failing run produced before it failed goes out first
        for index, (job, _) in enumerate(jobs):
            job.reply.send = self._send_blocking  # any error below goes out at once
            if index in run.failed:
                self._finish_error(
                    job, "shutting_down", "the agent stopped before the request finished"
                )
            elif index not in finished and failure is not None:
                self._finish_error(job, *failure)

    def _record_ok_batch(
        self, loaded: LoadedVersion, done: list[tuple[Job, float, float]], infer_s: float
    ) -> None:
        """`_record_ok` for the requests a run of a batch finished, together: one round of
        each metric's lock, not one per request."""
        self.count("requests_ok", len(done))
        timings = [(queued, infer_s, total, job.reply.chunks) for job, queued, total in done]
        self.metrics.requests_ok(loaded.model, loaded.version, timings)
        if log.isEnabledFor(logging.DEBUG):
            for job, _, total in done:
                _log_ok(job, total)

    def _record_ok(self, job: Job, queued_s: float, infer_s: float) -> None:
        model, total = job.request.model, time.monotonic() - job.received
        self.metrics.request_timing(model, queued_s, infer_s, total, job.reply.chunks)
        self.metrics.request_done(model, job.reply.version, "ok")
        _log_ok(job, total)

    @staticmethod
    def _timing(job: Job, queued_s: float, infer_s: float) -> dict[str, float]:
        total = time.monotonic() - job.received
        return {
            "queue_ms": round(queued_s * 1000, 3),
            "infer_ms": round(infer_s * 1000, 3),
            "total_ms": round(total * 1000, 3),
        }

    # -- housekeeping --------------------------------------------------------------------------

    def _housekeep(self) -> None:
        last_telemetry = time.monotonic()
        while not self._stop.wait(self._tick_s()):
            now = time.monotonic()
            if now - self._bad_last_report >= BAD_REQUEST_REPORT_S:
                self._report_bad_requests()
            interval = self.config.telemetry.interval_s  # read each time: SIGHUP may change it
            if interval and now - last_telemetry >= interval:
                late = now - last_telemetry > 2 * interval
                last_telemetry = now if late else last_telemetry + interval
                self._publish_telemetry()
            self._maintain_spool(now)
            self._nudge_writer()  # whatever was queued outside a request (events, resends)
            if self.reporter.notifier.enabled:
                self.reporter.tick(
                    ready=self.transport.connected.is_set(),
                    problem=self.health_problem(),
                    status=self._status(),
                )

    def _maintain_spool(self, now: float) -> None:
        """Every few seconds: expire old pending messages (TTL), forget old acknowledged ones."""
        period = min(5.0, max(0.2, self.config.resend.window_s / 2))
        if self.spool is None or now - self._spool_maintained < period:
            return
        self._spool_maintained = now
        expired = self.outbox.expire()
        if expired:
            self.count("spool_expired_messages", expired)
            log.warning("spool: %d message(s) older than ttl_s expired unsent", expired)
        history_s = max(self.config.mqtt.replay_after_reconnect_s, self.config.resend.window_s)
        if not self.config.resend.enabled:
            history_s = self.config.mqtt.replay_after_reconnect_s
        self.spool.purge_acked(history_s, self.config.resend.max_bytes)

    def _tick_s(self) -> float:
        """Fast until READY went out, then often enough for the watchdog pings."""
        if self.reporter.notifier.enabled and not self.reporter.ready_sent:
            return 0.1
        ping = self.reporter.ping_interval_s
        return 0.5 if ping is None else max(0.02, min(0.5, ping / 2))

    # -- health, systemd, metrics ----------------------------------------------------------------

    def health_problem(self) -> str | None:
        """None while healthy: the workers are alive and none is stuck, the MQTT loop runs.

        A broker that is down is not a problem here (the agent reconnects and spools; a
        restart would not help); a dead or stuck thread is, and stops the watchdog pings.
        """
        if not self._started:
            return "starting"
        if not self.scheduler.alive and not self._stop.is_set():
            return "an inference worker thread died"
        writer = self.outbox.writer
        if writer is not None and not writer.alive and not self._stop.is_set():
            return "the spool writer thread died"
        if self.scheduler.busy:
            age = time.monotonic() - self.scheduler.oldest_heartbeat()
            limit = self.config.systemd.stuck_after_s
            if age > limit:
                return f"an inference worker has run one job for {age:.0f} s (limit {limit:g} s)"
        return self._transport_problem()

    def _transport_problem(self) -> str | None:
        return None if self._stop.is_set() else self.transport.thread_problem()

    def health_report(self) -> tuple[bool, dict[str, Any]]:
        """For `/healthz` (and so `edge-agent health`, the container's HEALTHCHECK)."""
        problem = self.health_problem()
        return problem is None, {
            "problem": problem,
            "connected": self.transport.connected.is_set(),
            "status": self._status(),
        }

    def _status(self) -> str:
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
        if self._restart_pending:
            text += f"; restart needed for {len(self._restart_pending)} changed key(s)"
        return text

    def _gauges(self) -> Gauges:
        spool = self.spool
        busy = self.scheduler.busy
        return Gauges(
            queue_depth=self.scheduler.depth,
            busy_workers=busy,
            workers=self.config.scheduler.workers,
            outbox_depth=len(self.outbox),
            inflight_publishes=self.transport.inflight,
            connected=self.transport.connected.is_set(),
            reconnects=self.transport.reconnects,
            acked=self.transport.acked,
            publish_failures=self.transport.publish_failures,
            spool_messages=spool.count if spool is not None else None,
            spool_bytes=spool.bytes if spool is not None else None,
            spool_evicted=self.counters.get("spool_evicted_messages", 0),
            healthy=self.health_problem() is None,
            oldest_job_s=time.monotonic() - self.scheduler.oldest_heartbeat() if busy else 0.0,
            inventory=self.models.inventory(),
        )

    # -- SIGHUP ----------------------------------------------------------------------------------

    def reload(self, new: AgentConfig) -> ReloadReport:
        """Apply what is safe to change while running; list the keys that need a restart.

        Applied at once: log level and format, the QoS of replies, events, status and
        telemetry, the telemetry period, the input limits, the allowed reply prefixes, the
        drain timeout, `scheduler.inline_max_ms` and `systemd.stuck_after_s`. Everything else
        (broker connection, models, workers, queue, spool, metrics endpoint, the request
        subscription's QoS) keeps its old value until a restart.
        """
        # RELOADING/READY bracket a reload only after the first READY (never announce early).
        announce = self.reporter.ready_sent
        if announce:
            self.reporter.notifier.reloading("reloading the configuration")
        merged, applied, restart = plan_reload(self.config, new)
        if "log_level" in applied or "log_format" in applied:
            logs.reconfigure(merged.log_level, merged.log_format)
        self.config = merged
        self.limits = _limits(merged)
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
        self._restart_pending = restart
        status = self._status()
        if announce:
            self.reporter.notifier.ready(status)
        else:
            self.reporter.notifier.status(status)
        return report

    def telemetry(self) -> dict[str, Any]:
        """Counters and gauges, plus the Prometheus registry as plain data (`metrics`)."""
        with self._counter_lock:
            counters = dict(self.counters)
        if self._layouts.hits:  # counted by the network thread alone, without a lock
            counters["requests_layout_repeats"] = self._layouts.hits
        return {
            "ts": time.time_ns(),
            "epoch": self.epoch,
            "counters": counters,
            "gauges": {
                "queue_depth": self.scheduler.depth,
                "busy_workers": self.scheduler.busy,
                "outbox_depth": len(self.outbox),
                "spool_pending": self.spool.count if self.spool else 0,
                "spool_bytes": self.spool.bytes if self.spool else 0,
                "inflight_publishes": self.transport.inflight,
                "reconnects": self.transport.reconnects,
                "acked": self.transport.acked,
            },
            **({"sources": self.sources.snapshot()} if self.sources else {}),
            "metrics": self.metrics.snapshot(),
        }

    def _publish_telemetry(self) -> None:
        message = OutMessage(
            f"{self.root}/telemetry",
            wire.encode_payload(self.telemetry()),
            self.config.mqtt.qos.telemetry,
        )
        self.outbox.put_nowait_reserved(message)


@dataclass(frozen=True)
class ReloadReport:
    applied: list[str]  # dotted keys that changed and now have their new value
    restart_required: list[str]  # dotted keys that changed but keep the old value


# Keys (or whole sections) a running agent can take over from a reloaded configuration.
RELOADABLE = (
    "log_level",
    "log_format",
    "mqtt.qos.reply",
    "mqtt.qos.event",
    "mqtt.qos.status",
    "mqtt.qos.telemetry",
    "mqtt.allowed_reply_prefixes",
    "telemetry",
    "limits",
    "scheduler.drain_timeout_s",
    "scheduler.inline_max_ms",
    "systemd.stuck_after_s",
)


def plan_reload(old: AgentConfig, new: AgentConfig) -> tuple[AgentConfig, list[str], list[str]]:
    """The configuration to run with after a reload, the keys applied, the keys not applied."""
    applied: list[str] = []
    restart: list[str] = []

    def merge(a: Any, b: Any, prefix: str) -> Any:
        update = {}
        for name in type(a).model_fields:
            key = f"{prefix}{name}"
            va, vb = getattr(a, name), getattr(b, name)
            if va == vb:
                continue
            if key in RELOADABLE:
                update[name] = vb
                applied.extend(_changed_keys(va, vb, key))
            elif isinstance(va, BaseModel) and any(r.startswith(f"{key}.") for r in RELOADABLE):
                update[name] = merge(va, vb, f"{key}.")
            else:
                restart.extend(_changed_keys(va, vb, key))
        return a.model_copy(update=update) if update else a

    merged: AgentConfig = merge(old, new, "")
    return merged, applied, restart


def _changed_keys(a: Any, b: Any, key: str) -> list[str]:
    if isinstance(a, BaseModel) and isinstance(b, BaseModel):
        keys: list[str] = []
        for name in type(a).model_fields:
            keys += _changed_keys(getattr(a, name), getattr(b, name), f"{key}.{name}")
        return keys
    return [key] if a != b else []


def _log_ok(job: Job, total_s: float) -> None:
    reply = job.reply
    log.debug(
        "request %s (%s v%s): ok in %.1f ms, %d chunk(s)",
        job.request.id,
        job.request.model,
        reply.version,
        total_s * 1000,
        reply.chunks,
    )


def _limits(config: AgentConfig) -> wire.Limits:
    lim = config.limits
    return wire.Limits(
        max_payload_bytes=lim.max_payload_bytes,
        max_decompressed_bytes=lim.max_decompressed_bytes,
        max_depth=lim.max_depth,
        max_map_keys=lim.max_map_keys,
        max_tensor_elements=lim.max_tensor_elements,
        max_tensor_bytes=lim.max_tensor_bytes,
        max_rank=lim.max_rank,
        max_tensors=lim.max_tensors,
        max_items=lim.max_items,
    )


def _correlation_properties(correlation: bytes) -> Properties:
    """MQTT 5 properties of a spooled reply read back from disk."""
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    properties.CorrelationData = correlation
    return properties


def _required(
    specs: Sequence[TensorSpec], state_inputs: Mapping[str, str], given: Mapping[str, object]
) -> list[TensorSpec]:
    """Inputs a request must carry: all but the state inputs it left out (they start at zero)."""
    return [s for s in specs if s.name not in state_inputs or s.name in given]
