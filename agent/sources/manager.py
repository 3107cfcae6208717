"""Every local source of one agent (`SourceManager`: built from `[[sources]]`, started last,
stopped first) and their Prometheus metrics (`SourceCollector`, read at scrape time)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.config import AgentConfig
from agent.models.manager import ModelManager
from agent.ops.metric_families import PREFIX
from agent.ops.metrics import LATENCY_BUCKETS
from agent.protocol.errors import Limits
from agent.sources.pcm import PcmSourceRunner
from agent.sources.runner import Sender, SourceRunner, Submit

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


class SourceManager:
    """Every configured source of one agent: started last, stopped first."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        models: ModelManager,
        submit: Submit,
        sender: Sender,
        on_event: Callable[[dict[str, Any]], None],
        limits: Limits,
        waiting: Callable[[], int] = lambda: 0,
        registry: CollectorRegistry | None = None,
        after_written: Callable[[Callable[[], None]], None] = lambda callback: callback(),
    ) -> None:
        latency = None
        if registry is not None and any(s.enabled for s in config.sources):
            latency = Histogram(
                f"{PREFIX}_source_latency_seconds",
                "From a frame's capture to its result handed to the outbox",
                ["source"],
                buckets=LATENCY_BUCKETS,
                registry=registry,
            )
        self.runners = [
            (PcmSourceRunner if source.kind == "pcm" else SourceRunner)(
                source,
                agent_config=config,
                models=models,
                submit=submit,
                sender=sender,
                on_event=on_event,
                limits=limits,
                waiting=waiting,
                latency=latency,
                after_written=after_written,
            )
            for source in config.sources
            if source.enabled
        ]
        if registry is not None and self.runners:
            registry.register(SourceCollector(self))

    def __len__(self) -> int:
        return len(self.runners)

    def start(self) -> None:
        for runner in self.runners:
            runner.start()

    def stop(self, timeout: float = JOIN_TIMEOUT_S) -> None:
        """Stop reading: every source thread is told at once, then each is joined."""
        for runner in self.runners:
            runner.signal_stop()
        deadline = time.monotonic() + timeout
        for runner in self.runners:
            if not runner.join(max(0.1, deadline - time.monotonic())):
                log.warning("source %s: its thread did not stop in time", runner.name)

    def close(self) -> None:
        for runner in self.runners:
            runner.close()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {runner.name: runner.snapshot() for runner in self.runners}

    def runner(self, name: str) -> SourceRunner:
        for runner in self.runners:
            if runner.name == name:
                return runner
        raise KeyError(name)


class SourceCollector(Collector):
    """Per-source counters and gauges, read from the runners at scrape time."""

    COUNTERS = (
        ("frames", "Frames or records read by each local source"),
        ("published", "Results of each local source handed to the outbox"),
        ("dropped", "Frames replaced by a newer one before a worker took them (latest)"),
        ("errors", "Frames of each local source that failed"),
        ("failures", "Times a local source failed and was reopened"),
    )

    def __init__(self, manager: SourceManager) -> None:
        self._manager = manager

    def collect(self) -> Iterable[Metric]:
        runners = self._manager.runners
        for key, help_text in self.COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_source_{key}", help_text, labels=["source"])
            for runner in runners:
                family.add_metric([runner.name], getattr(runner.stats, key))
            yield family
        pending = GaugeMetricFamily(
            f"{PREFIX}_source_pending_frames", "Frames waiting for a worker", labels=["source"]
        )
        up = GaugeMetricFamily(
            f"{PREFIX}_source_running", "1 while a local source is running", labels=["source"]
        )
        for runner in runners:
            pending.add_metric([runner.name], runner.pending)
            up.add_metric([runner.name], int(runner.state == "running"))
        yield pending
        yield up
