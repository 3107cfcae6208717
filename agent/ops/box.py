"""Box telemetry: a `box-sampler` thread reads the box (agent.ops.jetson, agent.ops.nvml) every
`[telemetry] box_interval_s`, keeps the latest sample for `ROOT/telemetry` (`box`) and
`/metrics` (`edge_agent_box_*`), hands the board's power to the energy meter
(agent.ops.energy), and reports thermal throttling as events.

Sampling on a thread of its own, rather than at telemetry or scrape time, is what makes
energy per inference possible (the power must be known while models run) and throttling
events timely (the telemetry period is 30 s). A sample costs well under a millisecond (see
docs/operations.md); one that fails is logged and the next one tried: a sensor never stops
the agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.ops.energy import EnergyMeter
from agent.ops.jetson import BoxReader, BoxSample, Zone
from agent.ops.nvml import THROTTLING, NvmlReader
from agent.threads import NamedThread

log = logging.getLogger(__name__)

PREFIX = "edge_agent_box"
HYSTERESIS_C = 2.0  # a zone counts as cleared this far below its trip point


class ThrottleWatch:
    """One `thermal_throttle` event per crossing of a trip point, one `throttle_cleared` once
    back below it by HYSTERESIS_C: never one per sample."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        self._on_event = on_event
        self._throttled: set[str] = set()

    def zones(self, zones: list[Zone]) -> None:
        for z in zones:
            if z.trip_c is None:
                continue
            fields = {"zone": z.zone, "temp_c": z.temp_c, "trip_c": z.trip_c}
            hot, cleared = z.temp_c >= z.trip_c, z.temp_c <= z.trip_c - HYSTERESIS_C
            self._update(z.zone, hot, cleared, fields)

    def gpus(self, devices: list[dict[str, Any]]) -> None:
        """NVML's throttle reasons: heat or a power cap slowing the GPU down."""
        for device in devices:
            zone = f"nvml:gpu{device['index']}"
            reasons = sorted(THROTTLING.intersection(device.get("throttle_reasons", ())))
            fields = {"zone": zone, "reasons": reasons, "temp_c": device.get("temp_c")}
            cleared = not reasons and "throttle_reasons" in device
            self._update(zone, bool(reasons), cleared, fields)

    def _update(self, zone: str, hot: bool, cleared: bool, fields: dict[str, Any]) -> None:
        """Enter `zone` when `hot` and not yet throttled, leave it when `cleared`: an event
        for each change."""
        if hot and zone not in self._throttled:
            self._throttled.add(zone)
            self._on_event({"type": "thermal_throttle", **fields})
        elif cleared and zone in self._throttled:
            self._throttled.discard(zone)
            self._on_event({"type": "throttle_cleared", **fields})


class BoxMonitor(Collector):
    """`start()` discovers and starts the sampler, `close()` stops and joins it; the latest
    sample feeds `telemetry()` and `collect()` (registered on the agent's registry)."""

    def __init__(
        self,
        *,
        interval_s: float,
        root: Path,
        energy: EnergyMeter,
        on_event: Callable[[dict[str, Any]], None],
        nvml_module: Any = None,
    ) -> None:
        self.interval_s = interval_s
        self.root = root
        self._energy = energy
        self._watch = ThrottleWatch(on_event)
        self._nvml = NvmlReader(nvml_module)
        self._nvml_on = False
        self._reader: BoxReader | None = None
        self._latest: tuple[BoxSample, list[dict[str, Any]]] | None = None
        self.sample_s = 0.0  # the last sample's cost
        self._closing = threading.Event()
        self._thread = NamedThread(target=self._run, name="box-sampler", daemon=True)

    def start(self) -> None:
        """Discover the nodes (logged once), take a first sample, start the sampler."""
        try:
            self._reader = BoxReader(self.root)
            self._nvml_on = self._nvml.start()
        except Exception:  # an odd tree (a folder that cannot be listed): no box telemetry
            log.exception("box: discovery under %s failed; box telemetry off", self.root)
            self._reader = None
            return
        log.info("box: found %s, nvml=%s", self._reader.found, self._nvml_on)
        self.sample()
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._nvml.close()

    def _run(self) -> None:
        while not self._closing.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # a sensor never stops the agent: the next tick tries again
                log.exception("box: a sample failed")

    def sample(self) -> None:
        """Read everything once: the latest sample, the board power, throttling events."""
        if self._reader is None:
            return
        started = time.perf_counter()
        box = self._reader.sample()
        devices = self._nvml.sample() if self._nvml_on else []
        self.sample_s = time.perf_counter() - started
        self._latest = (box, devices)
        power = box.board_power_w
        if power is None and devices:
            power = sum(d.get("power_w", 0.0) for d in devices) or None
        self._energy.set_power(power)
        self._watch.zones(box.thermal)
        self._watch.gpus(devices)

    # -- telemetry and metrics ---------------------------------------------------------------

    def telemetry(self) -> dict[str, Any]:
        """The `box` key of `ROOT/telemetry`: only what was found."""
        out: dict[str, Any] = {}
        if self._latest is not None:
            box, devices = self._latest
            out = _box_fields(box, devices)
        energy = self._energy.snapshot()
        if energy:
            out["energy"] = energy
        out["sample_ms"] = round(self.sample_s * 1000.0, 3)
        return out

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if self._latest is None:
            return []
        box, devices = self._latest
        families = [*_rail_families(box), *_thermal_families(box), *_plain_families(box)]
        if devices:
            families.extend(_nvml_families(devices))
        return families


def _box_fields(box: BoxSample, devices: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if box.rails:
        out["rails"] = [asdict(r) for r in box.rails]
        out["board_watts"] = box.board_power_w
    if box.thermal:
        out["thermal"] = [
            {
                "zone": z.zone,
                "temp_c": z.temp_c,
                **({"trip_c": z.trip_c} if z.trip_c is not None else {}),
            }
            for z in box.thermal
        ]
    if box.gpu:
        out["gpu"] = dict(box.gpu)
    if box.emc_freq_hz is not None:
        out["emc_freq_hz"] = box.emc_freq_hz
    if box.power_mode is not None:
        out["power_mode"] = box.power_mode
    if box.memory:
        out["memory"] = dict(box.memory)
    if devices:
        out["nvml"] = devices
    return out


def _gauge(name: str, help_text: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=labels)


def _rail_families(box: BoxSample) -> list[Metric]:
    if not box.rails:
        return []
    watts = _gauge("rail_watts", "Power of each INA3221/INA238 rail", ["rail"])
    volts = _gauge("rail_volts", "Voltage of each rail", ["rail"])
    amps = _gauge("rail_amps", "Current of each rail", ["rail"])
    for rail in box.rails:
        watts.add_metric([rail.name], rail.watts)
        volts.add_metric([rail.name], rail.volts)
        amps.add_metric([rail.name], rail.amps)
    board = _gauge("board_watts", "The board's power (its input rail, else the rails' sum)")
    board.add_metric([], box.board_power_w or 0.0)
    return [watts, volts, amps, board]


def _thermal_families(box: BoxSample) -> list[Metric]:
    if not box.thermal:
        return []
    temp = _gauge("temperature_celsius", "Temperature of each thermal zone", ["zone"])
    trip = _gauge("trip_celsius", "Each zone's lowest passive/hot trip point", ["zone"])
    for z in box.thermal:
        temp.add_metric([z.zone], z.temp_c)
        if z.trip_c is not None:
            trip.add_metric([z.zone], z.trip_c)
    return [temp, trip]


def _plain_families(box: BoxSample) -> list[Metric]:
    gpu, memory = box.gpu, box.memory
    load = gpu.get("load_pct")
    items: list[tuple[str, str, float | None]] = [
        ("gpu_load_ratio", "GPU load, 0 to 1", None if load is None else load * 0.01),
        ("gpu_freq_hz", "GPU clock now", gpu.get("freq_hz")),
        ("gpu_max_freq_hz", "GPU clock ceiling", gpu.get("max_freq_hz")),
        ("emc_freq_hz", "Memory controller clock", box.emc_freq_hz),
        ("power_mode", "nvpmodel power mode id", _mode_id(box.power_mode)),
        ("ram_total_bytes", "RAM", memory.get("ram_total_b")),
        ("ram_used_bytes", "RAM in use (total less available)", memory.get("ram_used_b")),
        ("swap_total_bytes", "Swap", memory.get("swap_total_b")),
        ("swap_used_bytes", "Swap in use", memory.get("swap_used_b")),
    ]
    return [_value(n, h, v) for n, h, v in items if v is not None]


def _value(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _mode_id(mode: dict[str, object] | None) -> float | None:
    value = mode.get("id") if mode else None
    return float(value) if isinstance(value, int) else None


def _nvml_families(devices: list[dict[str, Any]]) -> list[Metric]:
    specs = (  # name, the device's key, help, what to divide the value by
        ("nvml_power_watts", "power_w", "GPU power (NVML)", 1),
        ("nvml_temperature_celsius", "temp_c", "GPU temperature (NVML)", 1),
        ("nvml_utilization_ratio", "util_pct", "GPU utilisation, 0 to 1 (NVML)", 100.0),
        ("nvml_memory_used_bytes", "mem_used_b", "GPU memory in use (NVML)", 1),
        ("nvml_memory_total_bytes", "mem_total_b", "GPU memory (NVML)", 1),
        ("nvml_sm_clock_hz", "sm_clock_hz", "SM clock (NVML)", 1),
    )
    families: list[Metric] = []
    for name, key, help_text, divisor in specs:
        family = _gauge(name, help_text, ["gpu"])
        for d in devices:
            if key in d:
                family.add_metric([str(d["index"])], d[key] / divisor)
        families.append(family)
    throttled = _gauge("nvml_throttled", "1 while heat or a power cap slows the GPU", ["gpu"])
    for d in devices:
        if "throttle_reasons" in d:
            throttled.add_metric(
                [str(d["index"])], int(bool(THROTTLING.intersection(d["throttle_reasons"])))
            )
    families.append(throttled)
    return families
