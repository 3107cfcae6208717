"""Wiring and lifecycle of the daemon: start order, ingress, execution, stop order.

Start: models are loaded (so the first request finds a warm session), then the MQTT
connection, then the workers. Stop: refuse new requests, let running ones finish within the
drain timeout (then cancel them with `shutting_down`), publish `offline`, flush, disconnect,
and only then close the model sessions.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import __version__, wire
from agent.backends.base import BackendOptions, InferenceError, TensorSpec
from agent.config import AgentConfig
from agent.models import ModelManager, summarize
from agent.outbox import Outbox, OutMessage
from agent.scheduler import Scheduler
from agent.streaming import Cancelled, Execution, ReplyStream, initial_state, merge_pieces
from agent.transport import EpochStore, Incoming, Transport
from agent.watcher import RepositoryWatcher

log = logging.getLogger(__name__)

# Bad input with no readable id is reported on `events` at most this often, with a count.
BAD_REQUEST_REPORT_S = 1.0


@dataclass(eq=False)  # identity, so jobs can sit in a set
class Job:
    request: wire.Request
    reply: ReplyStream
    received: float  # monotonic
    cancelled: threading.Event = field(default_factory=threading.Event)


def intra_op_threads(config: AgentConfig) -> int:
    """Threads per ONNX Runtime session so that workers x threads <= cores."""
    if config.models.intra_op_threads:
        return config.models.intra_op_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // config.scheduler.workers)


class Agent:
    """The daemon. `start()`, `wait_ready()`, then `stop()`; `run_forever()` for the CLI."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.root = config.root_topic
        self.started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.limits = wire.Limits(
            max_payload_bytes=config.limits.max_payload_bytes,
            max_decompressed_bytes=config.limits.max_decompressed_bytes,
            max_depth=config.limits.max_depth,
            max_map_keys=config.limits.max_map_keys,
            max_tensor_elements=config.limits.max_tensor_elements,
            max_tensor_bytes=config.limits.max_tensor_bytes,
            max_rank=config.limits.max_rank,
            max_tensors=config.limits.max_tensors,
            max_items=config.limits.max_items,
        )
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._bad_unreported = 0
        self._bad_last_reason = ""
        self._bad_last_report = 0.0
        self._accepting = False
        self._stop = threading.Event()
        self._running: set[Job] = set()
        self._running_lock = threading.Lock()
        self.epoch = 0
        self.outbox = Outbox(config.outbox.max_messages, config.outbox.error_reserve)
        self.models = ModelManager(
            config.models.repository,
            BackendOptions(
                intra_op_threads=intra_op_threads(config),
                providers=tuple(config.models.providers),
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
        self.scheduler: Scheduler[Job] = Scheduler(
            workers=config.scheduler.workers,
            queue_size=config.scheduler.queue_size,
            execute=self._execute,
            expire=lambda job: self._finish_error(
                job, "deadline_exceeded", "not started within deadline_ms"
            ),
            cancel=lambda job: self._finish_error(job, "shutting_down", "the agent is stopping"),
        )
        qos = config.mqtt.qos
        self.transport = Transport(
            config.mqtt,
            client_id=config.client_id,
            outbox=self.outbox,
            on_message=self._on_message,
            subscriptions=[(f"{self.root}/infer/+", qos.request_subscription)],
            will=lambda epoch: self._status_message("offline", epoch),
            on_connected=self._on_connected,
            epoch=EpochStore(config.state_dir / "epoch"),
        )
        self._housekeeping = threading.Thread(
            target=self._housekeep, name="housekeeping", daemon=True
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        self._load_models()
        summary = summarize(self.models.inventory())
        log.info("models:\n%s", summary or f"(none found in {self.config.models.repository})")
        self._accepting = True
        self.scheduler.start()
        self.transport.start()
        self._housekeeping.start()
        if self.config.models.repository.is_dir():
            self.watcher.start()

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
        self._accepting = False
        self._stop.set()
        self.watcher.close()
        drain = self.config.scheduler.drain_timeout_s
        cancel_timer = threading.Timer(drain, self._cancel_running)
        cancel_timer.name = "drain-timer"
        cancel_timer.start()
        self.scheduler.stop(drain + 5.0)
        cancel_timer.cancel()
        if self._housekeeping.is_alive():
            self._housekeeping.join(5.0)
        self.transport.close(final=self._status_message("offline", self.epoch), timeout=5.0)
        self.models.close(drain_timeout=1.0)
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

    def _publish_inventory(self) -> None:
        # While disconnected nothing is queued: the next connection publishes the current one.
        if self.transport.connected.is_set():
            self.outbox.put_nowait_reserved(self._inventory_message())

    def publish_event(self, event: dict[str, Any]) -> None:
        body = {"type": event["type"], "ts": time.time_ns(), **event}
        message = OutMessage(
            f"{self.root}/events", wire.encode_payload(body), self.config.mqtt.qos.event
        )
        if not self.outbox.put_nowait_reserved(message):
            self.count("events_dropped")

    def count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += n

    # -- ingress (paho's thread: must never block) -----------------------------------------------

    def _on_message(self, incoming: Incoming) -> None:
        prefix = f"{self.root}/infer/"
        if incoming.topic.startswith(prefix):
            self._on_request(incoming.topic[len(prefix) :], incoming)

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
        )

    def _reject(
        self, incoming: Incoming, model: str, payload: dict[str, Any] | None, error: wire.WireError
    ) -> None:
        """Answer a request that cannot be queued; requests without a readable id are counted."""
        request_id = error.request_id or (wire.read_request_id(payload) if payload else None)
        self.count(f"rejected_{error.code}")
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

    def _reply_allowed(self, topic: str) -> bool:
        return (
            len(topic) <= 256
            and not any(c in topic for c in "+#\0")
            and any(topic.startswith(p) for p in self.config.reply_prefixes)
        )

    def _send_nowait(self, message: OutMessage) -> None:
        if not self.outbox.put_nowait_reserved(message):
            self.count("replies_dropped_outbox_full")
            log.error("outbox full: an error reply to %s could not be queued", message.topic[:200])

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

    def _on_request(self, model: str, incoming: Incoming) -> None:
        self.count("requests_received")
        payload: dict[str, Any] | None = None
        try:
            payload = wire.decode_payload(incoming.payload, self.limits)
            if incoming.response_topic is not None and "reply_to" not in payload:
                payload = {**payload, "reply_to": incoming.response_topic}
            request = wire.parse_request(
                payload, model, self.limits, allowed_reply_prefixes=self.config.reply_prefixes
            )
            request.correlation_data = incoming.correlation_data
            if not self._accepting:
                raise wire.WireError("shutting_down", "the agent is stopping", request.id)
            self._precheck(request)
        except wire.WireError as e:
            self._reject(incoming, model, payload, e)
            return
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
        )
        deadline = None if request.deadline_ms is None else request.deadline_ms / 1000.0
        if not self.scheduler.submit(job, request.priority, deadline):
            self.count("rejected_overloaded")
            job.reply.send = self._send_nowait
            job.reply.error("overloaded", "the request queue is full; retry later")

    def _precheck(self, request: wire.Request) -> None:
        """Cheap checks against the serving version, so junk never takes a queue slot."""
        if not self.models.has_model(request.model):
            raise wire.WireError("unknown_model", f"no model named '{request.model}'", request.id)
        if request.version is not None:
            return  # checked against the pinned version when it is leased
        specs = self.models.serving_inputs(request.model)
        config = self.models.stream_config(request.model)
        if specs is None or config is None:
            raise wire.WireError(
                "unknown_model", f"model '{request.model}' has no ready version", request.id
            )
        wire.validate_inputs(
            request.id, request.inputs, _required(specs, config.state, request.inputs)
        )

    def _send_blocking(self, message: OutMessage) -> None:
        self.outbox.put(message)

    # -- execution (worker threads) ----------------------------------------------------------

    def _finish_error(self, job: Job, code: str, message: str) -> None:
        self.count(f"requests_{code}")
        job.reply.error(code, message)

    def _execute(self, job: Job, queued_s: float) -> None:
        request, reply = job.request, job.reply
        with self._running_lock:
            self._running.add(job)
        try:
            with self.models.lease(request.model, request.version) as lease:
                loaded = lease.loaded
                reply.version = loaded.version
                stream_config = loaded.config.stream
                specs = _required(loaded.session.inputs, stream_config.state, request.inputs)
                inputs = wire.validate_inputs(request.id, request.inputs, specs)
                inputs = initial_state(loaded.session, stream_config, inputs)
                execution = Execution(
                    loaded.session, stream_config, inputs, request.params, job.cancelled
                )
                if request.stream:
                    for index, outputs in execution.pieces():
                        reply.chunk(outputs, index)
                    reply.end(self._timing(job, queued_s, execution.stats.infer_s))
                else:
                    merged = merge_pieces(stream_config.mode, list(execution.pieces()))
                    reply.result(merged, self._timing(job, queued_s, execution.stats.infer_s))
            self.count("requests_ok")
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
        interval = self.config.telemetry.interval_s
        next_telemetry = time.monotonic() + interval if interval else None
        while not self._stop.wait(0.5):
            if time.monotonic() - self._bad_last_report >= BAD_REQUEST_REPORT_S:
                self._report_bad_requests()
            if next_telemetry is not None and time.monotonic() >= next_telemetry:
                next_telemetry += interval
                self._publish_telemetry()

    def telemetry(self) -> dict[str, Any]:
        with self._counter_lock:
            counters = dict(self.counters)
        return {
            "ts": time.time_ns(),
            "epoch": self.epoch,
            "counters": counters,
            "gauges": {
                "queue_depth": self.scheduler.depth,
                "busy_workers": self.scheduler.busy,
                "outbox_depth": len(self.outbox),
                "inflight_publishes": self.transport.inflight,
                "reconnects": self.transport.reconnects,
                "acked": self.transport.acked,
            },
        }

    def _publish_telemetry(self) -> None:
        message = OutMessage(
            f"{self.root}/telemetry",
            wire.encode_payload(self.telemetry()),
            self.config.mqtt.qos.telemetry,
        )
        self.outbox.put_nowait_reserved(message)


def _required(
    specs: Sequence[TensorSpec], state_inputs: Mapping[str, str], given: Mapping[str, object]
) -> list[TensorSpec]:
    """Inputs a request must carry: all but the state inputs it left out (they start at zero)."""
    return [s for s in specs if s.name not in state_inputs or s.name in given]
