"""The network thread's side of a request: read -> check -> store -> submit.

Runs on the thread that reads the socket (`mqtt-io`, or a publisher holding the io lock), so
nothing here may block. One reader (:class:`RequestReader`) turns the bytes of an incoming
message into either an admitted :class:`Job` or a :class:`Rejection` that already holds the
reply stream its error goes out on (id, reply topic, QoS, correlation data: whatever could
be read before the request failed). The reader takes the layout fast path
(`agent.protocol.layouts`) where the bytes repeat a recent request's layout, else the full
decode, and teaches the layouts what the full decode found.

:class:`Ingress` then stores a QoS 1/2 request in the spool (its acknowledgement to the broker
waits until it is on disk), runs a short request right here or queues it for the workers,
and answers a full queue with `overloaded`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.config import AgentConfig
from agent.delivery.packet_limit import PacketLimit
from agent.delivery.resend import Resender, parse_resend
from agent.delivery.spool import Spool
from agent.delivery.spool_items import AfterWrite, StoreRequest, request_key
from agent.delivery.spool_writer import SpoolWriter
from agent.inference import batching, generate_ask, images, short_runs, texts
from agent.inference.job import Job
from agent.inference.reply_stream import ReplySender, ReplyStream
from agent.inference.runner import checked_inputs, required_inputs
from agent.inference.scheduler import Scheduler
from agent.inference.short_runs import ShortRuns
from agent.models.manager import ModelManager, Serving
from agent.models.text_inputs import TEXT_INPUT
from agent.mqtt.connection import Transport
from agent.mqtt.messages import Incoming, correlation_properties
from agent.ops.counters import Counters
from agent.ops.metrics import AgentMetrics
from agent.protocol.errors import Limits, WireError
from agent.protocol.layouts import RequestLayouts
from agent.protocol.payload import decode_payload
from agent.protocol.requests import (
    Request,
    parse_request,
    read_request_id,
)
from agent.protocol.topics import BAD_LEVELS
from agent.service.announce import Announcer

log = logging.getLogger(__name__)


@dataclass
class Rejection:
    """A request that will not run: its error reply, addressed as far as it could be read
    (`reply` None: no readable id, so it is only counted and reported as an event)."""

    model: str
    code: str
    message: str
    reply: ReplyStream | None


@dataclass
class Admission:
    """A request that passed every check: its job, and the version it was checked against."""

    job: Job
    serving: Serving


class RequestReader:
    """Bytes in, an :class:`Admission` or a :class:`Rejection` out (the network thread's only)."""

    def __init__(self, config: AgentConfig, models: ModelManager) -> None:
        self.config = config
        self.limits = limits_of(config)
        self.reply_topics = config.reply_topics
        # The broker's packet limit (the agent's one, set by the transport at every CONNACK):
        # each reply stream's parts are cut to fit it, once, when the stream is made.
        mqtt = config.mqtt
        self.packet_limit = PacketLimit(mqtt.max_packet_bytes, mqtt5=mqtt.protocol == "5")
        self.layouts = RequestLayouts()
        self._models = models

    def reconfigure(self, config: AgentConfig) -> None:
        """A reload changed the limits or the allowed reply prefixes."""
        self.config = config
        self.limits = limits_of(config)
        self.reply_topics = config.reply_topics

    def read(self, model: str, incoming: Incoming, *, accepting: bool) -> Admission | Rejection:
        reply_topics, response_topic = self.reply_topics, incoming.response_topic
        payload: dict[str, Any] | None = None
        request = self.layouts.parse(
            incoming.payload, model, self.limits, reply_topics, response_topic
        )
        try:
            if request is None:
                payload = decode_payload(incoming.payload, self.limits)
                if response_topic is not None and "reply_to" not in payload:
                    payload = {**payload, "reply_to": response_topic}
                request = parse_request(payload, model, self.limits, reply_topics=reply_topics)
            request.correlation_data = incoming.correlation_data
            if not accepting:
                raise WireError("shutting_down", "the agent is stopping", request.id)
            serving, checked = self._check(request)
        except WireError as e:
            return self._rejection(incoming, model, payload, e)
        if payload is not None:
            self.layouts.learn(
                incoming.payload, payload, request, self.limits, reply_topics, response_topic
            )
        reply = self.reply_stream(
            request.id,
            model,
            request.version,
            request.reply_to,
            request.qos,
            request.correlation_data,
        )
        job = Job(
            request, reply, time.monotonic(), checked=checked, payload_bytes=len(incoming.payload)
        )
        return Admission(job, serving)

    def _check(self, request: Request) -> tuple[Serving, tuple[int, dict[str, Any]] | None]:
        """Cheap checks against the serving version, so junk never takes a queue slot; the
        checked inputs come back for a worker that leases that same version."""
        serving = self._models.serving(request.model)
        if serving is None:
            if not self._models.has_model(request.model):
                message = f"no model named '{request.model}'"
            else:
                message = f"model '{request.model}' has no ready version"
            raise WireError("unknown_model", message, request.id)
        if request.version is None and serving.generation is not None:
            generate_ask.params_of(request.params, serving.generation)  # the prompt: on a worker
        if request.version is not None or serving.stream.mode == "generate":
            # A pinned version is checked when it is leased; a prompt on a worker.
            return serving, None
        if serving.takes_text and TEXT_INPUT in request.inputs:
            return serving, None  # tokenized and checked on a worker (agent.inference.texts)
        texts.refuse_untaken_text(request.inputs, serving.takes_text, serving.inputs, request.id)
        image = serving.image_input
        if image is not None and images.is_image(request.inputs.get(image), serving.inputs, image):
            return serving, None  # decoded and checked on a worker (agent.inference.images)
        optional = (*serving.stream.state, *serving.defaults)
        specs = required_inputs(serving.inputs, optional, request.inputs)
        checked = checked_inputs(request.id, request.inputs, specs, serving.token_ids)
        return serving, (serving.version, checked)

    def _rejection(
        self,
        incoming: Incoming,
        model: str,
        payload: dict[str, Any] | None,
        error: WireError,
    ) -> Rejection:
        """The error reply, addressed with what was read before the request failed: the id
        the error names (or the decoded payload's), its reply topic where allowed, its QoS."""
        request_id = error.request_id or (read_request_id(payload) if payload else None)
        if request_id is None or model in BAD_LEVELS:
            # No reply topic to answer on (`ROOT/infer/..`: no model has such a name, and
            # its reply topic would have such a level): counted, not answered.
            return Rejection(model, error.code, error.message, None)
        reply_to = qos = None
        if payload is not None:
            candidate = payload.get("reply_to", incoming.response_topic)
            if self.reply_topics.problem(candidate) is None:
                reply_to = candidate
            asked = payload.get("qos")
            qos = asked if asked in (0, 1, 2) and not isinstance(asked, bool) else None
        reply = self.reply_stream(request_id, model, None, reply_to, qos, incoming.correlation_data)
        return Rejection(model, error.code, error.message, reply)

    def reply_stream(
        self,
        request_id: str,
        model: str,
        version: int | None,
        reply_to: str | None,
        qos: int | None,
        correlation: bytes | None,
    ) -> ReplyStream:
        config = self.config
        properties = None
        if correlation is not None and config.mqtt.protocol == "5":
            properties = correlation_properties(correlation)
        topic = reply_to or f"{config.root_topic}/result/{model}/{request_id}"
        qos = config.mqtt.qos.reply if qos is None else qos
        max_chunk_bytes = config.limits.max_chunk_bytes
        if self.packet_limit.limited:
            max_chunk_bytes = self.packet_limit.chunk_bytes(
                max_chunk_bytes, topic, qos, correlation
            )
        return ReplyStream(
            request_id=request_id,
            model=model,
            version=version,  # type: ignore[arg-type]  # set to the leased version later
            topic=topic,
            qos=qos,
            max_chunk_bytes=max_chunk_bytes,
            max_reply_bytes=config.limits.max_reply_bytes,
            properties=properties,
            correlation=correlation,
            stream_key=request_key(model, request_id),
        )


class Ingress:
    """`on_message` for every message the connection delivers (see the module docstring)."""

    def __init__(
        self,
        reader: RequestReader,
        *,
        scheduler: Scheduler[Any],
        sender: ReplySender,
        short_runs: ShortRuns,
        spool: Spool | None,
        writer: SpoolWriter | None,
        resender: Resender | None,
        announcer: Announcer,
        counters: Counters,
        metrics: AgentMetrics,
    ) -> None:
        self.reader = reader
        self.accepting = False
        self.connection: Transport | None = None  # set once the connection exists
        self._scheduler = scheduler
        self._sender = sender
        self._short_runs = short_runs
        self._spool = spool
        self._writer = writer
        self._resender = resender
        self._announcer = announcer
        self._counters = counters
        self._metrics = metrics
        self._outbox_has_room = sender.has_room
        root = reader.config.root_topic
        self._infer_prefix = f"{root}/infer/"  # every request's topic starts with it
        self._resend_topic = f"{root}/resend"
        self._cancel_topic = f"{root}/cancel"
        # Admitted requests by id, for ROOT/cancel; a job leaves once nothing holds it.
        # (model, id) -> the request running (or queued) under it, while anything holds it
        self._jobs: weakref.WeakValueDictionary[tuple[str, str], Job] = (
            weakref.WeakValueDictionary()
        )
        self._retained_seen: set[str] = set()  # topics of retained messages already logged

    def on_message(self, incoming: Incoming, replay: bool = False, pin: int | None = None) -> None:
        """`replay`: a request stored before a crash, run again; `pin`: the version its
        stream began on (where the request named none)."""
        if incoming.retain:
            self._ignore_retained(incoming)
            return
        prefix = self._infer_prefix
        if incoming.topic.startswith(prefix):
            self.on_request(incoming.topic[len(prefix) :], incoming, replay, pin)
        elif incoming.topic == self._resend_topic and self._resender is not None:
            self._on_resend(incoming)
        elif incoming.topic == self._cancel_topic:
            self._on_cancel(incoming)

    def on_request(
        self, model: str, incoming: Incoming, replay: bool = False, pin: int | None = None
    ) -> None:
        self._counters.add("requests_received")
        self._metrics.received.inc()
        outcome = self.reader.read(model, incoming, accepting=self.accepting)
        # Run before, maybe (stored before a crash; the broker's redelivery of one that was
        # not acknowledged yet): its subscribers may hold its first seqs (`ReplyStream.replayed`)
        rerun = replay or incoming.dup
        if isinstance(outcome, Rejection):
            if outcome.reply is not None:
                outcome.reply.replayed = rerun
            self._refuse(outcome)
            return
        job, request = outcome.job, outcome.job.request
        job.reply.replayed = rerun
        if pin is not None and request.version is None:  # leased at its run: else unknown_version
            request.version = pin
        if not replay and self._id_in_use(model, request.id, incoming.qos):
            self._counters.add("requests_duplicate")
            if not incoming.dup:  # not the broker's redelivery: another request, same id
                self._refuse_id_in_use(job)
            return
        if self._spool is not None and incoming.qos > 0:
            key = request_key(model, request.id)
            if not replay and self._unstorable(job, incoming):
                return  # the spool cannot be written (a full disk): answered `overloaded`
            if not replay and not self._store(key, incoming, job):
                self._counters.add("requests_duplicate")
                if not incoming.dup:  # not the broker's redelivery: another request, same id
                    self._refuse_id_in_use(job)
                return
            job.reply.request_key = key
        self._jobs[(model, request.id)] = job
        if self._resender is not None:
            self._resender.remember(request.id, job.reply.topic)
        deadline = None if request.deadline_ms is None else request.deadline_ms / 1000.0
        batch = batching.batch_spec(request, outcome.serving)
        short = batch is None and not replay and self._short(job, outcome.serving)
        if short and self._run_here(job):
            self._counters.add("requests_inline")  # it ran here, on the network thread
            return
        if not self._scheduler.submit(job, request.priority, deadline, batch):
            self._counters.add("rejected_overloaded")
            self._metrics.request_done(model, None, "overloaded")
            job.reply.error("overloaded", "the request queue is full; retry later")
            self._sender.send_now(job.reply.drain())

    def _id_in_use(self, model: str, request_id: str, qos: int) -> bool:
        """Whether `request_id` names a request of `model` still running or queued, whose
        stream this one's would interleave with. Where both are stored (QoS 1/2, a spool),
        the spool decides below: it tells the broker's redelivery (DUP) apart."""
        running = self._jobs.get((model, request_id))
        if running is None or running.reply.finished:
            return False
        stored_here = self._spool is not None and qos > 0
        return not (stored_here and running.reply.request_key is not None)

    def _run_here(self, job: Job) -> bool:
        """Run `job` on this thread, which holds the connection, if a worker slot is free: its
        replies are queued without waiting for room (`ReplySender.holding_connection`), which
        only this thread could make, by publishing and reading acknowledgements."""
        with self._sender.holding_connection():
            return self._scheduler.run_here(job)

    def _ignore_retained(self, incoming: Incoming) -> None:
        """A retained request or resend would run again at every start and reconnect: it is
        acknowledged and counted, never run (logged once per topic: it comes back on each
        subscribe of an MQTT 3.1.1 connection until someone clears it)."""
        self._counters.add("retained_ignored")
        topic = incoming.topic
        if topic not in self._retained_seen and len(self._retained_seen) < 1000:
            self._retained_seen.add(topic)
            log.warning(
                "ignored a retained message on %r: requests must not be retained (clear it "
                "with an empty retained publish on that topic)",
                topic[:200],
            )

    def _refuse_id_in_use(self, job: Job) -> None:
        """A request whose id names a request still running or stored. Where its topic may be
        that stream's (the same, or a stored one's, unknown here), whose subscribers would
        take an error for its terminal message, it is only counted and reported on
        `ROOT/events`; on another topic its error goes out with `seq` null, outside the
        numbering of the running stream."""
        self._counters.add("rejected_bad_request")
        self._metrics.request_done(job.request.model, None, "bad_request")
        request = job.request
        message = f"id {request.id!r} is in use by a running request; use a fresh id per request"
        running = self._jobs.get((request.model, request.id))
        if running is None or running.reply.topic == job.reply.topic:
            self._announcer.note_bad_request(f"{request.model}: {message}")
            return
        self._sender.send_now([job.reply.unsequenced_error("bad_request", message)])

    def _refuse(self, rejection: Rejection) -> None:
        """Answer a request that cannot be queued; one without a readable id is counted."""
        self._counters.add(f"rejected_{rejection.code}")
        self._metrics.request_done(rejection.model, None, rejection.code)
        reply = rejection.reply
        if reply is None:
            self._announcer.note_bad_request(rejection.message)
            return
        reply.error(rejection.code, rejection.message)
        self._sender.send_now(reply.drain())

    def _short(self, job: Job, serving: Serving) -> bool:
        """Whether the request may run on this, the network thread
        (agent.inference.short_runs): not a `steps` model (whose run count the request
        chooses), expected to be short, and room in the outbox for what it sends (this
        thread could not wait for room: only it makes some)."""
        request = job.request
        version = serving.version if request.version is None else request.version
        return (
            serving.stream.mode not in ("steps", "generate")
            and self._short_runs.is_short(request.model, version, job.payload_bytes)
            and self._outbox_has_room(
                short_runs.MAX_MESSAGES,
                # A message's payload, and generously its topic, ids and correlation data.
                self.reader.config.limits.max_chunk_bytes + 4096,
            )
        )

    def _store(self, key: str, incoming: Incoming, job: Job) -> bool:
        """Queue the request for the spool writer; the broker gets its acknowledgement once
        it is fsynced (the job runs meanwhile). False for a redelivery of a stored request:
        that one is acknowledged once the original is stored. Should its batch fail (a full
        disk), it is answered `overloaded` (`_store_failed`)."""
        assert self._spool is not None and self._writer is not None
        assert self.connection is not None
        # Called by the spool writer, which has the acknowledgements of a batch sent together.
        ack = self.connection.defer(incoming)
        if key in self._spool.request_keys:
            self._writer.submit(AfterWrite(lambda spool: ack()))
            return False
        self._spool.request_keys.add(key)
        self._writer.submit(
            StoreRequest(
                key,
                incoming.topic,
                incoming.payload,
                incoming.qos,
                incoming.response_topic,
                incoming.correlation_data,
                on_stored=ack,
                on_failed=lambda reason: self._store_failed(job, ack, reason),
            )
        )
        return True

    def _unstorable(self, job: Job, incoming: Incoming) -> bool:
        """While the spool writer fails (a full disk), a QoS 1/2 request cannot be stored
        before it is acknowledged: answered `overloaded` at once, never run."""
        assert self._writer is not None and self.connection is not None
        problem = self._writer.problem
        if problem is None:
            return False
        self._store_failed(job, self.connection.defer(incoming), problem)
        return True

    def _store_failed(self, job: Job, ack: Callable[[], None], reason: str) -> None:
        """The request cannot be stored (at ingress, or on the spool writer when its batch
        failed): answered `overloaded` unless its terminal message is out already (answered
        from memory), and acknowledged either way, so the broker does not hold it in flight."""
        self._counters.add("requests_store_failed")
        if job.reply.error("overloaded", reason):
            job.cancelled.set()  # a worker running it stops at its next run of the model
            self._counters.add("rejected_overloaded")
            self._metrics.request_done(job.request.model, None, "overloaded")
            self._sender.send_now(job.reply.drain())
        ack()

    def _on_cancel(self, incoming: Incoming) -> None:
        """`ROOT/cancel` `{id}`: the request ends at its next run of the model (a queued one
        when a worker takes it, without running), with `end` `finish_reason: "cancelled"`.
        Unknown or finished ids are ignored; a malformed message is only counted."""
        self._counters.add("cancel_received")
        try:
            payload = decode_payload(incoming.payload, self.reader.limits)
            request_id = read_request_id(payload)
            if request_id is None or set(payload) != {"id"}:
                raise WireError("bad_request", "a cancel is {id} with a request's id")
        except WireError as e:
            self._announcer.note_bad_request(f"cancel: {e.message}")
            return
        for (_, running_id), job in list(self._jobs.items()):  # under every model
            if running_id == request_id:
                job.cancelled.set(by_request=True)

    def _on_resend(self, incoming: Incoming) -> None:
        """Validated and rate-limited like any outside input; bad ones are only counted."""
        assert self._resender is not None
        self._counters.add("resend_received")
        try:
            payload = decode_payload(incoming.payload, self.reader.limits)
            request = parse_resend(
                payload,
                root=self.reader.config.root_topic,
                reply_topics=self.reader.reply_topics,
            )
        except WireError as e:
            self._announcer.note_bad_request(f"resend: {e.message}")
            return
        self._resender.handle(request)


def limits_of(config: AgentConfig) -> Limits:
    """The input limits of the configuration, as the wire guard takes them."""
    lim = config.limits
    return Limits(
        max_payload_bytes=lim.max_payload_bytes,
        max_decompressed_bytes=lim.max_decompressed_bytes,
        max_depth=lim.max_depth,
        max_map_keys=lim.max_map_keys,
        max_tensor_elements=lim.max_tensor_elements,
        max_tensor_bytes=lim.max_tensor_bytes,
        max_rank=lim.max_rank,
        max_tensors=lim.max_tensors,
        max_items=lim.max_items,
        max_image_pixels=lim.max_image_pixels,
    )
