"""Metric families recorded on the hot path with less work than prometheus_client's own:
a histogram whose labelled children are kept (`FastHistogram`), and the reply counters
taken under one lock (`ReplyTally`). Both export standard Prometheus families."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

PREFIX = "edge_agent"


class _Buckets:
    """One labelled histogram's counts: `observe` is a bisect and two additions under one lock.

    prometheus_client's Histogram loops over the bounds in Python and takes a lock per bucket
    and per sum; on the hot path (every acknowledgement, every request) that cost showed.
    """

    __slots__ = ("_bounds", "_counts", "_lock", "_sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def observe_many(self, values: Sequence[float]) -> None:
        """`observe` each, with one round of the lock (a batch run's requests)."""
        bounds, counts = self._bounds, self._counts
        indexes = [bisect.bisect_left(bounds, value) for value in values]
        with self._lock:
            for index in indexes:
                counts[index] += 1
            self._sum += sum(values)

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum


class FastHistogram:
    """A Prometheus histogram family (the same `_bucket`, `_count`, `_sum` samples) for values
    recorded on the hot path; `labels(...)` children are kept, `collect` exports them."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...] = (),
        *,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self._documentation = documentation
        self._labelnames = labelnames
        self._bounds = [float(b) for b in buckets]
        self._children: dict[tuple[str, ...], _Buckets] = {}
        self._lock = threading.Lock()
        if not labelnames:
            self._children[()] = _Buckets(self._bounds)
        registry.register(self)

    def labels(self, *values: str) -> _Buckets:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self.name}: expected labels {self._labelnames}")
            with self._lock:
                child = self._children.setdefault(values, _Buckets(self._bounds))
        return child

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def remove(self, *values: str) -> None:
        """Forget the child of these label values (not exported any more)."""
        with self._lock:
            self._children.pop(values, None)

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            counts, total = child.snapshot()
            cumulative, buckets = 0, []
            for bound, count in zip([*self._bounds, float("inf")], counts, strict=True):
                cumulative += count
                buckets.append((_bound(bound), cumulative))
            family.add_metric(list(values), buckets, total)
        return [family]


class ReplyTally:
    """Reply messages and their bytes, counted on every publish with one lock (two
    prometheus_client counters would take two), exported as two counters."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self.messages = 0
        self.bytes = 0
        registry.register(self)

    def add(self, payload_bytes: int, messages: int = 1) -> None:
        with self._lock:
            self.messages += messages
            self.bytes += payload_bytes

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            messages, size = self.messages, self.bytes
        return [
            CounterMetricFamily(
                f"{PREFIX}_reply_messages_published",
                "Reply messages (chunk, end, result, error) handed to the outbox",
                value=messages,
            ),
            CounterMetricFamily(
                f"{PREFIX}_reply_bytes_published",
                "Payload bytes of reply messages handed to the outbox",
                value=size,
            ),
        ]


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(value)
