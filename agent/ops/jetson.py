"""The box's power, heat, GPU and memory, read straight from sysfs and procfs (no daemon).

`tegrastats` and `jtop` read the same files; reading them ourselves costs a few dozen small
reads per sample and needs nothing installed. Paths are discovered once, under `root` (a fake
tree in the tests, the host's filesystem mounted elsewhere in a container), and never assumed
from one module: Orin (INA3221 / INA238 hwmon), Xavier and older (INA3221x iio), and any Linux
box (thermal zones, /proc/meminfo). A node that is missing is skipped; one that cannot be read
or holds garbage is skipped for that sample, counted, and logged once: a sensor never stops
the agent.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.ops.skip_log import SkipLog

log = logging.getLogger(__name__)

# Rails that measure the whole board's input (Orin, Xavier NX: VDD_IN; Nano, TX2: POM_5V_IN).
BOARD_RAILS = ("VDD_IN", "POM_5V_IN", "VIN_SYS_5V0")
THROTTLE_TRIP_TYPES = ("passive", "hot")
GPU_DEVFREQ = re.compile(r"(^gpu\.0$|\.gpu$|\.ga10b$|\.gv11b$|\.gp10b$|\.gb10b$)")
NO_SENSOR_C = -200.0  # Jetson zones of powered-off blocks read -256 °C


@dataclass(frozen=True)
class Rail:
    name: str
    volts: float
    amps: float
    watts: float


@dataclass(frozen=True)
class Zone:
    zone: str
    temp_c: float
    trip_c: float | None  # the lowest passive/hot trip point: where throttling starts


@dataclass(frozen=True)
class BoxSample:
    """One reading of everything found; absent parts are empty or None."""

    rails: list[Rail] = field(default_factory=list)
    thermal: list[Zone] = field(default_factory=list)
    gpu: dict[str, float] = field(default_factory=dict)  # load_pct, freq_hz, max_freq_hz
    emc_freq_hz: float | None = None
    power_mode: dict[str, object] | None = None  # {id, name}
    memory: dict[str, int] = field(default_factory=dict)

    @property
    def board_power_w(self) -> float | None:
        """The board's input rail where there is one, else the sum of the rails found."""
        for rail in self.rails:
            if rail.name.upper() in BOARD_RAILS:
                return rail.watts
        return sum(r.watts for r in self.rails) if self.rails else None


@dataclass(frozen=True)
class _Channel:
    name: str
    volts_mv: str | None
    amps_ma: str | None
    watts: str | None
    watts_scale: float  # to watts: hwmon power is in µW, iio power in mW


@dataclass(frozen=True)
class _ZonePaths:
    zone: str
    temp: str
    trip_c: float | None


class BoxReader:
    """`sample()` reads what `discover()` found (at construction); cheap and never raises."""

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._skips = SkipLog(log)
        self._channels = self._discover_rails()
        self._zones = self._discover_zones()
        self._gpu = self._discover_gpu()
        self._emc = self._discover_emc()
        self._modes = self._discover_power_modes()
        self._mode_status = _existing(root / "var/lib/nvpmodel/status")
        self._meminfo = _existing(root / "proc/meminfo")

    @property
    def errors(self) -> int:
        """Reads that failed or held garbage."""
        return self._skips.count

    @property
    def found(self) -> dict[str, int]:
        """What discovery found (logged at start)."""
        return {
            "rails": len(self._channels),
            "thermal_zones": len(self._zones),
            "gpu_nodes": sum(1 for p in self._gpu.values() if p),
            "emc": int(self._emc is not None),
            "power_mode": int(self._mode_status is not None),
            "meminfo": int(self._meminfo is not None),
        }

    # -- discovery ---------------------------------------------------------------------------

    def _discover_rails(self) -> list[_Channel]:
        channels: list[_Channel] = []
        seen: set[Path] = set()
        for folder in self._hwmon_folders():
            if folder.resolve() not in seen:
                seen.add(folder.resolve())
                channels.extend(_hwmon_channels(folder))
        for folder in sorted(self.root.glob("sys/bus/i2c/drivers/ina3221x/*/iio:device*")):
            channels.extend(_iio_channels(folder))
        return channels

    def _hwmon_folders(self) -> list[Path]:
        drivers = self.root / "sys/bus/i2c/drivers"
        found = sorted(drivers.glob("ina3221/*/hwmon/hwmon*")) + sorted(
            drivers.glob("ina238/*/hwmon/hwmon*")
        )
        for folder in sorted(self.root.glob("sys/class/hwmon/hwmon*")):
            name = _read(str(folder / "name"))
            if name is not None and name.strip().startswith(("ina3221", "ina238")):
                found.append(folder)
        return found

    def _discover_zones(self) -> list[_ZonePaths]:
        zones = []
        for folder in sorted(self.root.glob("sys/class/thermal/thermal_zone*"), key=_number):
            kind = _read(str(folder / "type"))
            if kind is not None and (folder / "temp").exists():
                zones.append(_ZonePaths(kind.strip(), str(folder / "temp"), _lowest_trip(folder)))
        return zones

    def _discover_gpu(self) -> dict[str, str | None]:
        devfreq = [
            d for d in sorted(self.root.glob("sys/class/devfreq/*")) if GPU_DEVFREQ.search(d.name)
        ]
        loads = [
            p
            for pattern in (
                "sys/devices/platform/gpu.0/load",
                "sys/devices/gpu.0/load",
                "sys/devices/platform/*.gpu/load",
                "sys/devices/platform/*.ga10b/load",
                "sys/devices/platform/bus@0/*.gpu/load",
            )
            for p in sorted(self.root.glob(pattern))
        ]
        folder = devfreq[0] if devfreq else None
        return {
            "load": str(loads[0]) if loads else None,
            "freq": _existing(folder / "cur_freq") if folder else None,
            "max_freq": _existing(folder / "max_freq") if folder else None,
        }

    def _discover_emc(self) -> str | None:
        for path in [
            self.root / "sys/kernel/debug/bpmp/debug/clk/emc/rate",
            *sorted(self.root.glob("sys/class/devfreq/*emc*/cur_freq")),
        ]:
            if os.access(path, os.R_OK):  # debugfs is often root-only: skipped silently
                return str(path)
        return None

    def _discover_power_modes(self) -> dict[int, str]:
        """`< POWER_MODEL ID=2 NAME=15W >` lines of /etc/nvpmodel.conf: mode names by id."""
        text = _read(str(self.root / "etc/nvpmodel.conf")) or ""
        return {
            int(m.group(1)): m.group(2)
            for m in re.finditer(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>", text)
        }

    # -- one sample --------------------------------------------------------------------------

    def sample(self) -> BoxSample:
        return BoxSample(
            rails=self._rails(),
            thermal=self._thermal(),
            gpu=self._gpu_state(),
            emc_freq_hz=self._number(self._emc),
            power_mode=self._power_mode(),
            memory=self._memory(),
        )

    def _rails(self) -> list[Rail]:
        rails = []
        for c in self._channels:
            volts_mv, amps_ma = self._number(c.volts_mv), self._number(c.amps_ma)
            watts = self._number(c.watts)
            if volts_mv is None or amps_ma is None:
                continue
            volts, amps = volts_mv / 1000.0, amps_ma / 1000.0
            power = watts * c.watts_scale if watts is not None else volts * amps
            rails.append(Rail(c.name, round(volts, 3), round(amps, 3), round(power, 3)))
        return rails

    def _thermal(self) -> list[Zone]:
        zones = []
        for z in self._zones:
            milli = self._number(z.temp)
            if milli is not None and milli / 1000.0 > NO_SENSOR_C:
                zones.append(Zone(z.zone, round(milli / 1000.0, 1), z.trip_c))
        return zones

    def _gpu_state(self) -> dict[str, float]:
        load = self._number(self._gpu["load"])
        freq = self._number(self._gpu["freq"])
        max_freq = self._number(self._gpu["max_freq"])
        gpu: dict[str, float] = {}
        if load is not None:
            gpu["load_pct"] = round(load / 10.0, 1)  # per-mille
        if freq is not None:
            gpu["freq_hz"] = freq
        if max_freq is not None:
            gpu["max_freq_hz"] = max_freq
        return gpu

    def _power_mode(self) -> dict[str, object] | None:
        if self._mode_status is None:
            return None
        text = self._text(self._mode_status)
        found = re.search(r"pmode:\s*(\d+)", text or "")
        if found is None:
            if text is not None:
                self._failed(self._mode_status, "no pmode")
            return None
        mode = int(found.group(1))
        name = self._modes.get(mode)
        return {"id": mode, **({"name": name} if name else {})}

    def _memory(self) -> dict[str, int]:
        text = self._text(self._meminfo)
        if text is None:
            return {}
        kib: dict[str, int] = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree"):
                number = rest.split()
                if number and number[0].isdigit():
                    kib[key] = int(number[0]) * 1024
        if "MemTotal" not in kib or "MemAvailable" not in kib:
            self._failed(self._meminfo or "", "no MemTotal/MemAvailable")
            return {}
        swap_total = kib.get("SwapTotal", 0)
        return {
            "ram_total_b": kib["MemTotal"],
            "ram_used_b": kib["MemTotal"] - kib["MemAvailable"],
            "swap_total_b": swap_total,
            "swap_used_b": swap_total - kib.get("SwapFree", swap_total),
        }

    # -- reading one node --------------------------------------------------------------------

    def _text(self, path: str | None) -> str | None:
        if path is None:
            return None
        text = _read(path)
        if text is None:
            self._failed(path, "unreadable")
        return text

    def _number(self, path: str | None) -> float | None:
        text = self._text(path)
        if text is None:
            return None
        try:
            return float(text.split()[0])
        except (ValueError, IndexError):
            self._failed(path or "", f"not a number: {text[:40]!r}")
            return None

    def _failed(self, path: str, why: str) -> None:
        self._skips.skip(path, "box: skipping %s (%s); logged once", path, why)


def _read(path: str) -> str | None:
    """A small node's text; None when it cannot be read (os.open: a fraction of open()'s
    cost, and sysfs nodes are a page at most)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _existing(path: Path) -> str | None:
    return str(path) if path.exists() else None


def _number(path: Path) -> int:
    digits = re.sub(r"\D", "", path.name)
    return int(digits) if digits else -1


def _hwmon_channels(folder: Path) -> list[_Channel]:
    """INA3221 (Orin: in1_label, in1_input mV, curr1_input mA) and INA238 (power1_input µW).
    A channel without a current (the "sum of shunt voltages" one) is no rail."""
    device = (_read(str(folder / "name")) or folder.name).strip()
    indexes = sorted(
        {int(m.group(1)) for p in folder.iterdir() if (m := re.match(r"curr(\d+)_input$", p.name))}
    )
    channels = []
    for n in indexes:
        label = _read(str(folder / f"in{n}_label")) or _read(str(folder / f"curr{n}_label"))
        channels.append(
            _Channel(
                label.strip() if label else f"{device}_{n}",
                _existing(folder / f"in{n}_input"),
                str(folder / f"curr{n}_input"),
                _existing(folder / f"power{n}_input"),
                1e-6,
            )
        )
    return [c for c in channels if c.volts_mv is not None]


def _iio_channels(folder: Path) -> list[_Channel]:
    """INA3221x (Xavier, TX2, Nano): rail_name_N, in_voltageN_input mV, in_currentN_input mA,
    in_powerN_input mW."""
    channels = []
    for path in sorted(folder.glob("rail_name_*"), key=_number):
        n = _number(path)
        name = _read(str(path))
        volts = _existing(folder / f"in_voltage{n}_input")
        amps = _existing(folder / f"in_current{n}_input")
        if name and volts and amps:
            power = _existing(folder / f"in_power{n}_input")
            channels.append(_Channel(name.strip(), volts, amps, power, 1e-3))
    return channels


def _lowest_trip(folder: Path) -> float | None:
    """The lowest passive or hot trip point in °C (read once: trips are set at boot)."""
    trips = []
    for kind_path in folder.glob("trip_point_*_type"):
        kind = _read(str(kind_path))
        temp = _read(str(kind_path.with_name(kind_path.name.replace("_type", "_temp"))))
        if kind and kind.strip() in THROTTLE_TRIP_TYPES and temp:
            try:
                trips.append(float(temp.split()[0]) / 1000.0)
            except (ValueError, IndexError):
                continue
    return min(trips) if trips else None
