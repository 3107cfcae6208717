"""Prometheus metrics of one agent and the telemetry snapshot (the `/metrics` + `/healthz`
endpoint that serves them is agent.ops.endpoint).

Every Agent has its own `CollectorRegistry` (never prometheus_client's global one), so two
agents in one process (the tests) never share or double-register a metric. Values that the
agent already keeps (queue depth, spool size, the inventory) are read at scrape time by a
custom collector instead of being copied on every change; per-request values (outcomes,
latencies) are recorded where they happen.

Label values are bounded: `model` is a model the repository has (anything else published on
`ROOT/infer/{model}` counts as `_unknown`, so junk topics cannot grow the registry without
limit), `version` is a loaded version or `none`, `outcome` is `ok` or a contract error code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from agent.ops.energy import EnergyMeter
from agent.ops.metric_families import PREFIX, FastHistogram, ReplyTally

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "_unknown"
NO_VERSION = "none"
# From sub-millisecond (small models on the CPU) to a minute (a long decode at shutdown).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STATES = ("loading", "ready", "failed", "draining", "unloaded")


@dataclass(frozen=True)
class Gauges:
    """What the agent reports at scrape time (read by `AgentCollector`)."""

    queue_depth: int = 0
    busy_workers: int = 0
    workers: int = 0
    outbox_depth: int = 0
    inflight_publishes: int = 0
    connected: bool = False
    reconnects: int = 0
    acked: int = 0
    publish_failures: int = 0
    spool_messages: int | None = None
    spool_bytes: int | None = None
    spool_evicted: int = 0
    healthy: bool = True
    oldest_job_s: float = 0.0
    inventory: Mapping[str, Any] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)  # agent.ops.counters snapshot
    # (model, version) -> GPU bytes its session holds (`ModelManager.device_bytes`)
    device_bytes: Mapping[tuple[str, int], int] = field(default_factory=dict)
    # (model, version) -> (bytes held, prompt tokens served) (`ModelManager.prefix_caches`)
    prefix_caches: Mapping[tuple[str, int], tuple[int, int]] = field(default_factory=dict)


# What went wrong and was handled without stopping: (counter, help), each exported as
# `edge_agent_<counter>_total` so an alert can see it without reading telemetry.
SAFETY_COUNTERS: tuple[tuple[str, str], ...] = (
    ("spool_quarantined", "Corrupt spool files moved aside at start"),
    ("epoch_recovered", "Unreadable epoch files recovered at start"),
    ("requests_store_failed", "QoS 1/2 requests that could not be stored (answered overloaded)"),
    ("retained_ignored", "Retained requests acknowledged and never run"),
    ("messages_quarantined", "Messages the broker refused for good, taken out of the spool"),
    ("broker_session_lost", "Connections on which the broker had lost the agent's session"),
)


class AgentCollector(Collector):
    """Gauges and counters the agent keeps itself, turned into metric families per scrape."""

    def __init__(self, read: Callable[[], Gauges]) -> None:
        self._read = read

    def describe(self) -> Iterable[Metric]:
        """Nothing read at registration: the agent registers this before its parts exist."""
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            g = self._read()
        except Exception:  # a scrape must never take the agent down
            log.exception("metrics: reading the agent's gauges failed")
            return
        yield from _gauges(
            ("queue_depth", "Requests waiting for a worker", g.queue_depth),
            ("inflight_requests", "Requests being run by a worker", g.busy_workers),
            ("workers", "Inference worker threads", g.workers),
            ("outbox_depth", "Encoded messages waiting for the network", g.outbox_depth),
            ("inflight_publishes", "QoS 1/2 publishes awaiting the ack", g.inflight_publishes),
            ("mqtt_connected", "1 while the broker connection is up", int(g.connected)),
            ("healthy", "1 while workers and the MQTT loop are healthy", int(g.healthy)),
            ("oldest_job_seconds", "How long the longest running job has run", g.oldest_job_s),
        )
        yield CounterMetricFamily(
            f"{PREFIX}_mqtt_reconnects", "Broker connections lost since start", value=g.reconnects
        )
        yield CounterMetricFamily(
            f"{PREFIX}_publish_acks", "QoS 1/2 publishes the broker acknowledged", value=g.acked
        )
        yield CounterMetricFamily(
            f"{PREFIX}_publish_failures", "Publishes the broker refused", value=g.publish_failures
        )
        if g.spool_messages is not None:
            yield from _gauges(
                ("spool_messages", "Messages in the on-disk spool", g.spool_messages),
                ("spool_bytes", "Payload bytes in the on-disk spool", g.spool_bytes or 0),
            )
            yield CounterMetricFamily(
                f"{PREFIX}_spool_evicted_messages",
                "Messages the full spool evicted (drop_oldest)",
                value=g.spool_evicted,
            )
        for name, help_text in SAFETY_COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=g.counters.get(name, 0))
        yield from _model_families(g.inventory)
        yield _device_bytes(g.device_bytes)
        yield from _prefix_caches(g.prefix_caches)


def _gauges(*items: tuple[str, str, float]) -> Iterator[Metric]:
    for name, help_text, value in items:
        yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _model_families(inventory: Mapping[str, Any]) -> Iterator[Metric]:
    states = GaugeMetricFamily(
        f"{PREFIX}_model_version_state",
        "1 for the state each version folder is in",
        labels=["model", "version", "state"],
    )
    serving = GaugeMetricFamily(
        f"{PREFIX}_model_serving_version",
        "The version requests without `version` get (absent: none ready)",
        labels=["model"],
    )
    for name, model in sorted(inventory.get("models", {}).items()):
        for number, entry in sorted(model.get("versions", {}).items()):
            for state in STATES:
                states.add_metric([name, str(number), state], int(entry.get("state") == state))
        if model.get("serving") is not None:
            serving.add_metric([name], model["serving"])
    yield states
    yield serving


def _device_bytes(held: Mapping[tuple[str, int], int]) -> Metric:
    family = GaugeMetricFamily(
        f"{PREFIX}_model_device_bytes",
        "GPU memory a loaded version's session holds (TensorRT: its buffers and kept arrays)",
        labels=["model", "version"],
    )
    for (model, version), count in sorted(held.items()):
        family.add_metric([model, str(version)], count)
    return family


def _prefix_caches(caches: Mapping[tuple[str, int], tuple[int, int]]) -> Iterator[Metric]:
    held = GaugeMetricFamily(
        f"{PREFIX}_prefix_cache_bytes",
        "Bytes of decoder caches a version keeps for later prompts ([generate] prefix_cache_mb)",
        labels=["model", "version"],
    )
    served = CounterMetricFamily(
        f"{PREFIX}_prefix_cache_tokens",
        "Prompt tokens taken from a version's prefix cache instead of run again",
        labels=["model", "version"],
    )
    for (model, version), (nbytes, tokens) in sorted(caches.items()):
        held.add_metric([model, str(version)], nbytes)
        served.add_metric([model, str(version)], tokens)
    yield held
    yield served


class AgentMetrics:
    """The metrics of one agent; the `record_*` methods are thread-safe and cheap."""

    def __init__(
        self,
        read: Callable[[], Gauges],
        *,
        device: str,
        version: str,
        known_model: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._known_model = known_model
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._metric_of: dict[int, Any] = {}  # id(metric) -> metric, for `forget_gone`
        r = self.registry
        Info(PREFIX, "The agent build and device", registry=r).info(
            {"version": version, "device": device}
        )
        self.received = Counter(
            f"{PREFIX}_requests_received", "Request messages received", registry=r
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by their terminal outcome (ok or the error code)",
            ["model", "version", "outcome"],
            registry=r,
        )
        self.first_chunk = FastHistogram(
            f"{PREFIX}_time_to_first_chunk_seconds",
            "From the request's arrival to its first chunk handed to the outbox",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = FastHistogram(
            f"{PREFIX}_queue_seconds",
            "Time a request waited for a worker",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = FastHistogram(
            f"{PREFIX}_inference_seconds",
            "Time spent in the model's session runs for one request",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.total = FastHistogram(
            f"{PREFIX}_request_duration_seconds",
            "From arrival to the terminal message of a request that ran",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.chunks = Counter(
            f"{PREFIX}_chunks_published",
            "Chunk messages (parts included) of reply streams handed to the outbox",
            ["model"],
            registry=r,
        )
        self.replies = ReplyTally(r)
        self.ack = FastHistogram(
            f"{PREFIX}_publish_ack_seconds",
            "From a QoS 1/2 publish to the broker's acknowledgement",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.model_load = Histogram(
            f"{PREFIX}_model_load_seconds",
            "Loading, checking and warming up one model version",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        self.batch_requests = FastHistogram(
            f"{PREFIX}_batch_requests",
            "Requests run together in one dynamic batch ([batching] in a model's config)",
            ("model",),
            buckets=(2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=r,
        )
        self.reloads = Counter(
            f"{PREFIX}_config_reloads", "SIGHUP reloads by result", ["result"], registry=r
        )
        r.register(AgentCollector(read))
        self.energy = EnergyMeter()  # fed by the box sampler (agent.ops.box) and the runner
        r.register(self.energy)
        # edge_agent_process_resident_memory_bytes, _cpu_seconds_total, _open_fds, ...
        ProcessCollector(namespace=PREFIX, registry=r)

    # -- recording -----------------------------------------------------------------------------

    def model_label(self, model: str) -> str:
        return model if self._known_model(model) else UNKNOWN_MODEL

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: `labels()` validates and locks on every call,
        and a request records several metrics. Bounded like the label values themselves."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
            self._metric_of[id(metric)] = metric
        return child

    def request_done(self, model: str, version: int | None, outcome: str) -> None:
        label = self.model_label(model)
        version_label = NO_VERSION if version is None else str(version)
        self._child(self.requests, label, version_label, outcome).inc()

    def request_timing(
        self, model: str, queue_s: float, infer_s: float, total_s: float, chunks: int
    ) -> None:
        label = self.model_label(model)
        self._child(self.queue, label).observe(queue_s)
        self._child(self.inference, label).observe(infer_s)
        self._child(self.total, label).observe(total_s)
        if chunks:
            self._child(self.chunks, label).inc(chunks)

    def requests_ok(
        self, model: str, version: int, timings: Sequence[tuple[float, float, float, int]]
    ) -> None:
        """`request_done` (ok) and `request_timing` for requests of one batch run, each
        `(queue_s, infer_s, total_s, chunks)`: one round of each metric's lock, not one per
        request."""
        label = self.model_label(model)
        self._child(self.queue, label).observe_many([t[0] for t in timings])
        self._child(self.inference, label).observe_many([t[1] for t in timings])
        self._child(self.total, label).observe_many([t[2] for t in timings])
        chunks = sum(t[3] for t in timings)
        if chunks:
            self._child(self.chunks, label).inc(chunks)
        self._child(self.requests, label, str(version), "ok").inc(len(timings))

    def batch_run(self, model: str, requests: int) -> None:
        self._child(self.batch_requests, self.model_label(model)).observe(requests)

    def first_chunk_after(self, model: str, seconds: float) -> None:
        self._child(self.first_chunk, self.model_label(model)).observe(seconds)

    def reply_sent(self, payload_bytes: int, messages: int = 1) -> None:
        """`messages` replies of `payload_bytes` in all were queued."""
        self.replies.add(payload_bytes, messages)

    def model_loaded(self, model: str, seconds: float) -> None:
        self._child(self.model_load, model).observe(seconds)

    def forget_gone(self, inventory: Mapping[str, Any]) -> None:
        """Series of models (and versions) no longer in `inventory` (`ROOT/models`' payload)
        stop being exported: a fleet that ships models under new names, or swaps versions
        often, would otherwise grow every scrape and the registry for good. A late request of
        a removed model counts as `_unknown`."""
        models = inventory.get("models", {})
        self.energy.forget(models.__contains__)
        for key in list(self._children):
            metric_id, labels = key
            if labels[0] == UNKNOWN_MODEL:
                continue
            model = models.get(labels[0])
            gone = model is None or (  # the model, or (requests by version) its version
                metric_id == id(self.requests)
                and labels[1] != NO_VERSION
                and labels[1] not in model.get("versions", {})
            )
            if gone:
                del self._children[key]
                self._metric_of[metric_id].remove(*labels)

    # -- the telemetry snapshot ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The registry as plain data for `ROOT/telemetry`: values, histograms as count + sum.

        Unlabelled metrics map to a number; labelled ones to `{"label=value,...": number}`.
        Buckets and `_created` samples are left out: the topic is a summary, `/metrics` has
        the rest.
        """
        out: dict[str, Any] = {}
        for metric in self.registry.collect():
            if metric.type == "info":
                continue
            for sample in metric.samples:
                if sample.name.endswith(("_bucket", "_created", "_gsum", "_gcount")):
                    continue
                key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                value = sample.value
                number: float | int = int(value) if float(value).is_integer() else value
                if key:
                    out.setdefault(sample.name, {})[key] = number
                else:
                    out[sample.name] = number
        return out
