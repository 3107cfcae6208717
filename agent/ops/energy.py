"""Energy per inference: the board's power integrated over each run of a model.

The box sampler (agent.ops.box) keeps the latest board power here; the runner brackets every
run of a model with `begin()` / `end()`. A run's energy is that power times the seconds its
model ran (`Run.infer_s`), times the run's share of the box while it ran: with k runs in
flight at once the board power is split between them by run time (a processor-sharing clock
advances by dt/k while k runs are in flight; a run's share is that clock's advance over its
wall time). A run alone on the box gets the whole board power; two overlapping runs get half
each for the overlap. The figure includes whatever else the box did meanwhile (idle power,
the CPU's pre- and post-processing): it is what the model costs on this box, not the GPU's
own energy.

Exported per model as the mean over the last `WINDOW` runs (their joules over their
inferences: a batch run of n requests is n inferences).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "edge_agent"
WINDOW = 50  # runs per model in the mean


@dataclass(frozen=True)
class RunToken:
    wall: float  # monotonic at begin
    shared: float  # the processor-sharing clock at begin


class _ModelEnergy:
    __slots__ = ("recent", "runs")

    def __init__(self) -> None:
        self.recent: deque[tuple[float, int]] = deque(maxlen=WINDOW)  # (joules, inferences)
        self.runs = 0

    def per_inference(self) -> float:
        inferences = sum(n for _, n in self.recent)
        return sum(j for j, _ in self.recent) / inferences if inferences else 0.0


class EnergyMeter(Collector):
    """Thread-safe; inert (begin returns None) until a board power is known."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._power_w: float | None = None
        self._in_flight = 0
        self._shared = 0.0  # the processor-sharing clock
        self._last = time.monotonic()
        self._models: dict[str, _ModelEnergy] = {}

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the models `keep` says no to (removed from the repository)."""
        with self._lock:
            for model in [m for m in self._models if not keep(m)]:
                del self._models[model]

    def set_power(self, watts: float | None) -> None:
        """The latest board power (the sampler, every tick); None: unknown, runs not counted."""
        self._power_w = watts

    def begin(self, now: float | None = None) -> RunToken | None:
        if self._power_w is None:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            self._advance(now)
            self._in_flight += 1
            return RunToken(now, self._shared)

    def end(
        self,
        token: RunToken | None,
        model: str,
        seconds: float,
        inferences: int,
        now: float | None = None,
    ) -> None:
        """A run `begin` returned `token` for ran the model for `seconds` (inside the session)."""
        if token is None:
            return
        now = time.monotonic() if now is None else now
        power = self._power_w
        with self._lock:
            self._advance(now)
            self._in_flight -= 1
            wall = now - token.wall
            share = (self._shared - token.shared) / wall if wall > 0 else 1.0
            if power is None or inferences <= 0 or seconds <= 0:
                return
            entry = self._models.setdefault(model, _ModelEnergy())
            entry.recent.append((power * seconds * min(1.0, share), inferences))
            entry.runs += 1

    def _advance(self, now: float) -> None:
        if self._in_flight:
            self._shared += (now - self._last) / self._in_flight
        self._last = now

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """`{model: {joules_per_inference, runs}}` for telemetry's `box.energy`."""
        with self._lock:
            return {
                model: {"joules_per_inference": round(e.per_inference(), 6), "runs": e.runs}
                for model, e in sorted(self._models.items())
            }

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            f"{PREFIX}_model_energy_joules_per_inference",
            f"Board energy per inference, mean over the model's last {WINDOW} runs",
            labels=["model"],
        )
        for model, entry in self.snapshot().items():
            family.add_metric([model], entry["joules_per_inference"])
        return [family]
