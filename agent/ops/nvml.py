"""Discrete NVIDIA GPUs through NVML (`nvidia-ml-py`, imported as `pynvml`), optional.

Jetson has no NVML (agent.ops.jetson reads its sysfs); on an x86 box with a discrete GPU this
gives the same picture: power, temperature, utilisation, memory, clocks and why the clocks are
held down. The module is imported late and only here: without it, or without a driver, NVML is
skipped. Every call is guarded on its own: a GPU that does not support one query (power on
some consumer cards) still reports the rest.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from agent.ops.skip_log import SkipLog

log = logging.getLogger(__name__)

# nvmlClocksThrottleReason* bits (nvml.h), by the names telemetry uses.
THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)
# The reasons that mean heat or power is slowing the GPU down (events).
THROTTLING = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
)


class NvmlReader:
    """`start()` once (False: no NVML here), `sample()` per tick, `close()` at the end."""

    def __init__(self, module: Any = None) -> None:
        """`module`: the pynvml API (a double in the tests); None imports `pynvml`."""
        self._nvml = module
        self._handles: list[Any] = []
        self._skips = SkipLog(log)

    @property
    def errors(self) -> int:
        """Queries that failed (skipped)."""
        return self._skips.count

    def start(self) -> bool:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError:
                return False
        try:
            self._nvml.nvmlInit()
            count = self._nvml.nvmlDeviceGetCount()
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:  # no driver, no GPU (a Jetson, a container without one)
            log.info("box: NVML not available (%s)", e)
            self._handles = []
            return False
        return bool(self._handles)

    def close(self) -> None:
        if self._handles:
            self._handles = []
            self._call("shutdown", self._nvml.nvmlShutdown)

    def sample(self) -> list[dict[str, Any]]:
        return [self._device(i, h) for i, h in enumerate(self._handles)]

    def _device(self, index: int, handle: Any) -> dict[str, Any]:
        nvml = self._nvml
        out: dict[str, Any] = {"index": index}
        power_mw = self._call("power", nvml.nvmlDeviceGetPowerUsage, handle)
        if power_mw is not None:
            out["power_w"] = round(power_mw / 1000.0, 3)
        sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        temp = self._call("temperature", nvml.nvmlDeviceGetTemperature, handle, sensor)
        if temp is not None:
            out["temp_c"] = float(temp)
        rates = self._call("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
        if rates is not None:
            out["util_pct"] = float(rates.gpu)
            out["mem_util_pct"] = float(rates.memory)
        memory = self._call("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            out["mem_used_b"] = int(memory.used)
            out["mem_total_b"] = int(memory.total)
        clock = getattr(nvml, "NVML_CLOCK_SM", 1)
        sm = self._call("clock", nvml.nvmlDeviceGetClockInfo, handle, clock)
        if sm is not None:
            out["sm_clock_hz"] = float(sm) * 1e6  # MHz
        reasons = self._call("throttle", nvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
        if reasons is not None:
            out["throttle_reasons"] = [name for bit, name in THROTTLE_REASONS if reasons & bit]
        return out

    def _call(self, what: str, function: Any, *args: Any) -> Any:
        """One NVML query; its NVMLError (or anything) skips that value, logged once."""
        try:
            return function(*args)
        except Exception as e:
            self._skips.skip(what, "box: NVML %s query failed (%s); skipped, logged once", what, e)
            return None
