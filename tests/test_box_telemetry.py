"""Box telemetry: sysfs readers on recorded Orin and Xavier trees (tests/data/sysfs/README.md),
throttling events, energy per inference, NVML through a double, broken nodes."""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.ops.box import BoxMonitor
from agent.ops.energy import EnergyMeter
from agent.ops.jetson import BoxReader
from agent.ops.nvml import NvmlReader

DATA = Path(__file__).parent / "data" / "sysfs"
ORIN_RAILS = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
XAVIER_RAILS = "sys/bus/i2c/drivers/ina3221x/1-0040/iio:device0"


@pytest.fixture
def orin(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / "orin", tmp_path / "orin"))


@pytest.fixture
def xavier(tmp_path: Path) -> Path:
    return Path(shutil.copytree(DATA / "xavier", tmp_path / "xavier"))


def write(root: Path, node: str, value: object) -> None:
    (root / node).write_text(f"{value}\n")


def zone_temp(root: Path, zone: int, celsius: float) -> None:
    write(root, f"sys/class/thermal/thermal_zone{zone}/temp", int(celsius * 1000))


def test_orin_tree_is_read_and_follows_changes(orin: Path) -> None:
    reader = BoxReader(orin)
    first = reader.sample()
    assert [(r.name, r.volts, r.amps, r.watts) for r in first.rails] == [
        ("VDD_IN", 5.0, 1.6, 8.0),
        ("VDD_CPU_GPU_CV", 5.0, 0.4, 2.0),
        ("VDD_SOC", 5.0, 0.3, 1.5),
    ]
    assert first.board_power_w == 8.0  # the input rail, not the sum
    assert [(z.zone, z.temp_c, z.trip_c) for z in first.thermal] == [
        ("cpu-thermal", 45.5, 99.0),
        ("gpu-thermal", 44.0, 99.0),
        ("soc0-thermal", 46.2, 99.5),  # cv0 reads -256 °C: powered off, skipped
    ]
    assert first.gpu == {"load_pct": 23.5, "freq_hz": 612e6, "max_freq_hz": 918e6}
    assert first.power_mode == {"id": 2, "name": "15W"}
    assert first.emc_freq_hz is None
    assert first.memory == {
        "ram_total_b": 7999000 * 1024,
        "ram_used_b": 2999000 * 1024,
        "swap_total_b": 3999000 * 1024,
        "swap_used_b": 100000 * 1024,
    }
    write(orin, f"{ORIN_RAILS}/curr1_input", 2400)
    write(orin, "sys/devices/platform/gpu.0/load", 990)
    zone_temp(orin, 1, 71.25)
    write(orin, "var/lib/nvpmodel/status", "pmode:0000 fmode:quiet")
    second = reader.sample()
    assert second.board_power_w == 12.0
    assert second.gpu["load_pct"] == 99.0
    assert second.thermal[1].temp_c == 71.2
    assert second.power_mode == {"id": 0, "name": "MAXN"}
    assert reader.errors == 0


def test_xavier_tree_is_read(xavier: Path) -> None:
    reader = BoxReader(xavier)
    sample = reader.sample()
    assert [(r.name, r.watts) for r in sample.rails] == [
        ("GPU", 2.908),
        ("CPU", 8.784),
        ("SOC", 17.548),
    ]
    assert sample.board_power_w == pytest.approx(2.908 + 8.784 + 17.548)  # no input rail
    assert [(z.zone, z.trip_c) for z in sample.thermal] == [
        ("CPU-therm", 96.5),
        ("GPU-therm", 96.5),
        ("PMIC-Die", None),
    ]
    assert sample.gpu == {"load_pct": 0.0, "freq_hz": 318750000.0, "max_freq_hz": 1377e6}
    assert sample.emc_freq_hz == 1.6e9
    assert sample.power_mode == {"id": 0, "name": "MODE_30W_ALL"}
    assert sample.memory["swap_total_b"] == 0
    write(xavier, f"{XAVIER_RAILS}/in_power0_input", 10000)
    assert reader.sample().rails[0].watts == 10.0


def test_broken_nodes_are_skipped_without_raising(orin: Path, caplog: Any) -> None:
    reader = BoxReader(orin)
    write(orin, f"{ORIN_RAILS}/curr2_input", "garbage")
    write(orin, "sys/class/thermal/thermal_zone0/temp", "")
    write(orin, "proc/meminfo", "nothing useful")
    (orin / "sys/devices/platform/gpu.0/load").unlink()
    unreadable = orin / "sys/class/devfreq/17000000.gpu/cur_freq"
    unreadable.chmod(0)
    try:
        for _ in range(3):
            sample = reader.sample()
    finally:
        unreadable.chmod(0o644)
    assert [r.name for r in sample.rails] == ["VDD_IN", "VDD_SOC"]
    assert [z.zone for z in sample.thermal] == ["gpu-thermal", "soc0-thermal"]
    assert sample.memory == {}
    if os.geteuid() != 0:  # root reads a 0000 file
        assert "freq_hz" not in sample.gpu
    assert "load_pct" not in sample.gpu
    assert reader.errors >= 12
    warnings = [r for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warnings) == len({r.getMessage() for r in warnings})  # each node logged once


def test_an_empty_root_finds_nothing(tmp_path: Path) -> None:
    sample = BoxReader(tmp_path).sample()
    assert (sample.rails, sample.thermal, sample.gpu, sample.memory) == ([], [], {}, {})
    assert sample.board_power_w is None and sample.power_mode is None


def test_energy_per_inference_matches_a_hand_computation() -> None:
    meter = EnergyMeter()
    assert meter.begin(now=0.0) is None  # no power known: not counted
    meter.set_power(10.0)
    for start in (1.0, 2.0, 3.0):  # 10 W for 0.05 s runs: 0.5 J each
        token = meter.begin(now=start)
        meter.end(token, "m", 0.05, 1, now=start + 0.05)
    token = meter.begin(now=4.0)  # a batch of 4 for 0.2 s: 2 J, 0.5 J per inference
    meter.end(token, "m", 0.2, 4, now=4.2)
    assert meter.snapshot() == {"m": {"joules_per_inference": 0.5, "runs": 4}}
    # Two runs fully overlapping for 1 s share the board: 5 J each.
    a, b = meter.begin(now=10.0), meter.begin(now=10.0)
    meter.end(a, "x", 1.0, 1, now=11.0)
    meter.end(b, "y", 1.0, 1, now=11.0)
    snapshot = meter.snapshot()
    assert snapshot["x"]["joules_per_inference"] == pytest.approx(5.0)
    assert snapshot["y"]["joules_per_inference"] == pytest.approx(5.0)
    registry = CollectorRegistry()
    registry.register(meter)
    text = generate_latest(registry).decode()
    assert 'edge_agent_model_energy_joules_per_inference{model="m"} 0.5' in text


class FakeNvml:
    """The pynvml calls the reader makes, with the real names and units."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self) -> None:
        self.reasons = 0x1  # gpu_idle
        self.shut = False

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 70250  # mW

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 64

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=2 << 30, total=16 << 30, free=14 << 30)

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        assert clock == self.NVML_CLOCK_SM
        return 1410  # MHz

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        return self.reasons


def test_nvml_through_a_double(tmp_path: Path) -> None:
    nvml = FakeNvml()
    reader = NvmlReader(nvml)
    assert reader.start()
    assert reader.sample() == [
        {
            "index": 0,
            "power_w": 70.25,
            "temp_c": 64.0,
            "util_pct": 87.0,
            "mem_util_pct": 40.0,
            "mem_used_b": 2 << 30,
            "mem_total_b": 16 << 30,
            "sm_clock_hz": 1410e6,
            "throttle_reasons": ["gpu_idle"],
        }
    ]
    events: list[dict[str, Any]] = []
    box = BoxMonitor(
        interval_s=3600,
        root=tmp_path,
        energy=EnergyMeter(),
        on_event=events.append,
        nvml_module=nvml,
    )
    box.start()
    nvml.reasons = 0x20 | 0x4  # sw_thermal + sw_power_cap
    box.sample()
    box.sample()
    nvml.reasons = 0
    box.sample()
    box.close()
    assert nvml.shut
    assert [(e["type"], e["zone"], e["reasons"]) for e in events] == [
        ("thermal_throttle", "nvml:gpu0", ["sw_power_cap", "sw_thermal"]),
        ("throttle_cleared", "nvml:gpu0", []),
    ]
    assert box.telemetry()["nvml"][0]["power_w"] == 70.25
    registry = CollectorRegistry()
    registry.register(box)
    assert 'edge_agent_box_nvml_power_watts{gpu="0"} 70.25' in generate_latest(registry).decode()


def test_nvml_absent_or_failing_is_skipped() -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    assert not NvmlReader(Broken()).start()

    class NoPower(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
            raise RuntimeError("Not Supported")

    reader = NvmlReader(NoPower())
    assert reader.start()
    assert "power_w" not in reader.sample()[0] and reader.errors == 1


THERMAL_EVENTS = ("thermal_throttle", "throttle_cleared")


def test_zone_crossing_its_trip_point_gives_one_event_each_way(
    orin: Path, broker: Any, repository: Path, make_agent: Any, make_client: Any
) -> None:
    agent = make_agent(
        broker,
        repository,
        toml=f'[telemetry]\nbox_interval_s = 0.02\nbox_root = "{orin}"\n',
    )
    client = make_client(broker, agent)
    events: queue.Queue[dict[str, Any]] = queue.Queue()

    def on_event(topic: str, message: dict[str, Any], raw: bytes) -> None:
        if message.get("type") in THERMAL_EVENTS:  # not the agent's other events (models...)
            events.put(message)

    client.listen(f"{agent.root}/events", on_event)
    time.sleep(0.3)
    zone_temp(orin, 1, 99.5)  # gpu-thermal past its passive trip at 99 °C
    event = events.get(timeout=5)
    assert (event["type"], event["zone"], event["temp_c"], event["trip_c"]) == (
        "thermal_throttle",
        "gpu-thermal",
        99.5,
        99.0,
    )
    zone_temp(orin, 1, 97.5)  # below the trip, within the hysteresis: still throttled
    time.sleep(0.3)
    zone_temp(orin, 1, 96.0)
    event = events.get(timeout=5)
    assert (event["type"], event["zone"], event["temp_c"]) == (
        "throttle_cleared",
        "gpu-thermal",
        96.0,
    )
    time.sleep(0.2)
    assert events.empty()  # once per crossing, not every sample
    box = agent.telemetry()["box"]
    assert box["rails"][0] == {"name": "VDD_IN", "volts": 5.0, "amps": 1.6, "watts": 8.0}
    assert box["gpu"] == {"load_pct": 23.5, "freq_hz": 612e6, "max_freq_hz": 918e6}
    assert box["power_mode"] == {"id": 2, "name": "15W"}
    assert {"zone": "gpu-thermal", "temp_c": 96.0, "trip_c": 99.0} in box["thermal"]
    assert box["memory"]["ram_total_b"] == 7999000 * 1024
    text = generate_latest(agent.metrics.registry).decode()
    assert 'edge_agent_box_rail_watts{rail="VDD_IN"} 8.0' in text
    assert 'edge_agent_box_temperature_celsius{zone="gpu-thermal"} 96.0' in text
    assert "edge_agent_box_gpu_load_ratio 0.235" in text
    assert "edge_agent_box_gpu_freq_hz 6.12e+08" in text
    assert "edge_agent_box_ram_used_bytes" in text
    threads = [t.name for t in threading.enumerate()]
    assert "box-sampler" in threads
    agent.stop()
    assert "box-sampler" not in [t.name for t in threading.enumerate()]


def test_box_interval_zero_starts_nothing(
    orin: Path, broker: Any, repository: Path, make_agent: Any
) -> None:
    agent = make_agent(
        broker, repository, toml=f'[telemetry]\nbox_interval_s = 0\nbox_root = "{orin}"\n'
    )
    assert agent.housekeeping.box is None and agent.health.box is None
    assert "box" not in agent.telemetry()
    assert agent.metrics.energy.begin() is None
    text = generate_latest(agent.metrics.registry).decode()
    assert "edge_agent_box_" not in text
    assert "box-sampler" not in [t.name for t in threading.enumerate()]
