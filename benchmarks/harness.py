"""What the benchmark suites share: the agent as its own process, a counting subscriber that
costs next to nothing, paho clients with TCP_NODELAY, and the machine's description."""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import paho.mqtt.client as mqtt

from agent.demo.broker import EmbeddedBroker
from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload

REPO = Path(__file__).resolve().parent.parent
Result = TypeVar("Result")


def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


INFLIGHT = 64  # the agent's default [mqtt] max_inflight, for every paho client here


def connect(port: int, host: str = "127.0.0.1") -> mqtt.Client:
    """A connected paho client (MQTT 5, TCP_NODELAY, its own network thread)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_socket_open = _nodelay
    client.max_inflight_messages_set(INFLIGHT)
    connected = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: connected.set()
    client.connect(host, port)
    client.loop_start()
    if not connected.wait(10):
        raise RuntimeError("no CONNACK from the benchmark broker")
    return client


def mqtt_client(broker: EmbeddedBroker) -> mqtt.Client:
    return connect(broker.port, broker.host)


def close_client(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


def subscribe(client: mqtt.Client, topic: str, qos: int) -> None:
    done = threading.Event()
    client.on_subscribe = lambda c, u, mid, rc, p: done.set()
    client.subscribe(topic, qos)
    if not done.wait(10):
        raise RuntimeError(f"no SUBACK for {topic}")


def stat_cpu_s(text: str) -> float:
    """CPU seconds, user and system, in the text of a `/proc/PID/stat` (a process's, all its
    threads) or `/proc/PID/task/TID/stat` (one thread's) file."""
    fields = text.rsplit(")", 1)[1].split()  # after the name, which may hold anything
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """CPU time of a process so far, all its threads, user and system (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_cpu_s(f.read())


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


class StampSubscriber:
    """`mosquitto_sub` (C) printing the receive time of every message on a topic.

    A Python subscriber at QoS 1 tops out near the rates being measured and would take CPU
    from the publisher under test on a 2-core box; the C client keeps up with anything a
    Python publisher sends, so the figures are the publisher's. The subscription is known to
    be in place once a probe message published to the topic has arrived.
    """

    FORMAT = "%U"  # mosquitto_sub's line for a message: its receive time

    def __init__(self, broker: EmbeddedBroker, topic: str, qos: int, expect: int | None = None):
        if shutil.which("mosquitto_sub") is None:
            raise RuntimeError(
                "mosquitto_sub not found: install the Mosquitto clients "
                "(Debian/Ubuntu: sudo apt-get install mosquitto-clients)"
            )
        command = ["mosquitto_sub", "-h", broker.host, "-p", str(broker.port), "-t", topic]
        command += ["-q", str(qos), "-F", self.FORMAT, "--nodelay"]
        if expect is not None:
            command += ["-C", str(expect + 1)]  # + the probe
        self.stamps: list[float] = []
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._reader = threading.Thread(target=self._read, name="bench-stamps", daemon=True)
        self._reader.start()
        probe = mqtt_client(broker)
        try:
            deadline = time.monotonic() + 10
            while not self.stamps:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    raise RuntimeError(f"mosquitto_sub did not subscribe to {topic}")
                # A filter's wildcards stand for one concrete probe topic.
                concrete = "/".join("probe" if p in ("+", "#") else p for p in topic.split("/"))
                probe.publish(concrete, b"probe", 1).wait_for_publish(5)
                time.sleep(0.05)
        finally:
            close_client(probe)
        time.sleep(0.05)  # a second probe may still be on its way
        self._skip = len(self.stamps)

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                self._take(line)
            except ValueError:
                continue

    def _take(self, line: str) -> None:
        """One line of mosquitto_sub's output (ValueError: not a message's line)."""
        self.stamps.append(float(line))

    @property
    def count(self) -> int:
        return len(self.stamps) - self._skip

    def times(self) -> list[float]:
        return self.stamps[self._skip :]

    def wait_for(self, n: int, timeout: float) -> bool:
        """True once `n` messages arrived, False at `timeout`."""
        return self.wait_quiet(n, timeout, quiet_s=math.inf)

    def wait_quiet(self, n: int, timeout: float, quiet_s: float = 2.0) -> bool:
        """As `wait_for`, but also give up once nothing arrived for `quiet_s`: at QoS 0 the
        broker drops what a subscriber that falls behind cannot take, so `n` may never come."""
        deadline = time.monotonic() + timeout
        seen, since = self.count, time.monotonic()
        while self.count < n and time.monotonic() < deadline:
            time.sleep(0.01)
            if self.count != seen:
                seen, since = self.count, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return self.count >= n

    def rate(self, skip: float = 0.1) -> float:
        """Messages per second between the first arrival after `skip` of them and the last."""
        times = self.times()
        kept = times[int(len(times) * skip) :]
        if len(kept) < 2 or kept[-1] <= kept[0]:
            return 0.0
        return (len(kept) - 1) / (kept[-1] - kept[0])

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:  # seen once on a loaded VM: never mask the real error
            self._process.kill()
            self._process.wait(10)
        self._reader.join(5)


class PayloadSubscriber(StampSubscriber):
    """A `StampSubscriber` that keeps every payload too (printed in hex by `mosquitto_sub`,
    decoded only when asked for): the chunks' own fields (`ts`, `index`, an `end`'s timing)
    at the price of a C client, where a Python subscriber took about as much of the 2-core
    box's CPU a message as the agent's whole path."""

    FORMAT = "%U %x"

    def __init__(self, broker: EmbeddedBroker, topic: str, qos: int, expect: int | None = None):
        self.payloads: list[bytes] = []
        super().__init__(broker, topic, qos, expect)

    def _take(self, line: str) -> None:
        stamp, _, payload = line.strip().partition(" ")
        received, body = float(stamp), bytes.fromhex(payload)
        self.payloads.append(body)  # first: `count` reads the stamps
        self.stamps.append(received)

    def bodies(self) -> list[dict[str, Any]]:
        """The CBOR maps received after the probe, in arrival order (others left out)."""
        found = []
        for payload in self.payloads[self._skip :]:
            try:
                body = decode_payload(payload, Limits())
            except WireError:
                continue
            if isinstance(body, dict):
                found.append(body)
        return found


def one_request(
    broker: EmbeddedBroker, root: str, model: str, body: dict[str, Any], messages: int
) -> PayloadSubscriber:
    """Publish one request to `root/infer/model` and wait for the `messages` messages of its
    reply stream (`end` included) at a `PayloadSubscriber`, returned closed."""
    from agent.protocol.payload import encode_payload

    subscriber = PayloadSubscriber(broker, f"{root}/result/{model}/+", 1, expect=messages)
    client = mqtt_client(broker)
    try:
        client.publish(f"{root}/infer/{model}", encode_payload(body), 1)
        if not subscriber.wait_for(messages, max(60.0, messages / 500)):
            raise RuntimeError(f"{model}: {subscriber.count} of {messages} messages arrived")
    finally:
        close_client(client)
        subscriber.close()
    return subscriber


class AgentProcess:
    """`edge-agent run` as its own process, as on a box; `tree` runs another checkout's agent
    (benchmarks/history.py) with this checkout's harness."""

    def __init__(
        self,
        workdir: Path,
        broker: EmbeddedBroker,
        repository: Path | None,
        *,
        device_id: str = "bench",
        extra: str = "",
        tree: Path = REPO,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: more environment variables for the agent's process."""
        self.device_id = device_id
        self.root = f"edge/{device_id}"
        workdir.mkdir(parents=True, exist_ok=True)
        repository = repository or workdir / "no-models"
        repository.mkdir(parents=True, exist_ok=True)
        self.repository = repository
        self.config = workdir / f"agent-{device_id}.toml"
        self.config.write_text(
            f'device_id = "{device_id}"\nstate_dir = "{workdir / ("state-" + device_id)}"\n'
            f'log_level = "warning"\n'
            f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\nreconnect_max_s = 0.5\n'
            f'[models]\nrepository = "{repository}"\ndebounce_s = 0.05\n'
            "[telemetry]\ninterval_s = 0\n[metrics]\nport = 0\n" + extra
        )
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent.cli", "run", "--config", str(self.config)],
            env=env,
            cwd=tree,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mb(self) -> float:
        return rss_mb(self.pid)

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_online(broker: EmbeddedBroker, root: str, since: float, timeout: float = 60) -> float:
    """Seconds from `since` (perf_counter) until `ROOT/status` says online (retained)."""
    online = threading.Event()
    arrived: list[float] = []

    def on_message(c: mqtt.Client, u: Any, message: Any) -> None:
        try:
            state = decode_payload(message.payload, Limits()).get("state")
        except WireError:
            return
        if state == "online" and not online.is_set():
            arrived.append(time.perf_counter())
            online.set()

    client = mqtt_client(broker)
    client.on_message = on_message
    try:
        subscribe(client, f"{root}/status", 1)
        if not online.wait(timeout):
            raise RuntimeError(f"{root} did not come online")
    finally:
        close_client(client)
    return arrived[0] - since


def unique_id(prefix: str = "b") -> str:
    return f"{prefix}{uuid.uuid4().hex[:15]}"


def versions() -> dict[str, str]:
    found = {}
    for name in ("paho-mqtt", "cbor2", "onnxruntime", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "-"
    mosquitto = subprocess.run(
        ["mosquitto", "-h"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    found["mosquitto"] = mosquitto[0].split()[-1] if mosquitto else "?"
    found["python"] = platform.python_version()
    return found


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def section_main(
    doc: str | None,
    prefix: str,
    measure: Callable[[EmbeddedBroker, Path, bool], Result],
    section: Callable[[Result], list[str]],
    met: Callable[[Result], bool],
    argv: list[str] | None = None,
) -> int:
    """A section run alone (`[--quick]`): `measure` in a temporary folder named `prefix...`
    with a broker of its own, its `section` printed with the time taken; 0 where `met`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, EmbeddedBroker() as broker:
        result = measure(broker, Path(tmp), args.quick)
    print("\n".join(section(result)))
    print(f"({time.monotonic() - started:.1f} s)")
    return 0 if met(result) else 1
