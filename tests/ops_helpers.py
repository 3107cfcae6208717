"""Helpers for the operations tests: a notify socket that records, an agent process, scrapes,
the CBOR messages of a topic as they arrive."""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from agent.client import AgentClient

CLI = [sys.executable, "-m", "agent.cli"]
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
for _name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "CREDENTIALS_DIRECTORY"):
    ENV.pop(_name, None)


@dataclass
class Notification:
    at: float  # monotonic time of arrival
    fields: dict[str, str]
    raw: str


@dataclass
class NotifyListener:
    """A real AF_UNIX datagram socket, as systemd's; records every notification it gets.

    `abstract=True` binds in Linux's abstract namespace (`@name`), as systemd does for some
    services; otherwise a short path under /tmp (sun_path holds 108 bytes).
    """

    abstract: bool = False
    messages: list[Notification] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._dir: str | None = None
        if self.abstract:
            name = f"edge-agent-test-{uuid.uuid4().hex[:12]}"
            self._sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self._dir = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")
            self.address = os.path.join(self._dir, "notify")
            self._sock.bind(self.address)
        self._sock.settimeout(0.05)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sd-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            text = data.decode()
            fields = dict(line.split("=", 1) for line in text.split("\n") if "=" in line)
            with self._cond:
                self.messages.append(Notification(time.monotonic(), fields, text))
                self._cond.notify_all()

    def wait_for(
        self, key: str, value: str | None = None, timeout: float = 10.0, after: float = 0.0
    ) -> Notification:
        """The first notification (arrived after `after`) carrying `key` (= `value`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for m in self.messages:
                    if m.at >= after and key in m.fields and value in (None, m.fields[key]):
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [m.raw for m in self.messages][-10:]
                    raise AssertionError(f"no {key}={value or '*'} within {timeout} s; got {seen}")
                self._cond.wait(left)

    def with_key(self, key: str, since: float = 0.0) -> list[Notification]:
        with self._cond:
            return [m for m in self.messages if key in m.fields and m.at >= since]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def base_config(
    tmp: Path, broker_host: str, broker_port: int, repository: Path, extra: str = ""
) -> str:
    """TOML for an agent process: its own device id and state, metrics on a free port."""
    from agent.demo.broker import free_port

    device = f"ops-{uuid.uuid4().hex[:8]}"
    return (
        f'device_id = "{device}"\n'
        f'state_dir = "{tmp / "state"}"\n'
        f"{extra}\n"
        f'[mqtt]\nhost = "{broker_host}"\nport = {broker_port}\n'
        f'[models]\nrepository = "{repository}"\nsettle_s = 0.1\n'
        f"[metrics]\nport = {free_port()}\n"
    )


def start_agent(
    config: Path, *args: str, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "run", "--config", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, **(env or {})},
    )


class LineReader:
    """Collects a child's stderr lines as they come (the child must never block on a pipe)."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(stream,), name="log-reader")
        self._thread.daemon = True
        self._thread.start()

    def _run(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 10.0) -> bool:
        return wait_until(lambda: needle in self.text(), timeout)

    def join(self, timeout: float = 10.0) -> None:
        self._thread.join(timeout)


def run_cli(
    *args: str, timeout: float = 30, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})}
    )


def scrape(url: str, timeout: float = 5.0) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as response:
        text: str = response.read().decode()
        return text


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text format (labels must match exactly)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric == name and got == want:
            return float(value)
    return None


def wait_until(check: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def listen(client: AgentClient, topic: str) -> queue.Queue[dict[str, Any]]:
    """The decoded messages arriving on `topic` from now on, in order (undecodable ones left
    out)."""
    messages: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(topic, lambda t, m, raw: messages.put(m) if m is not None else None)
    return messages


def wait_message(
    messages: queue.Queue[dict[str, Any]], check: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """The first message of `messages` that passes `check`; fails when `timeout` seconds pass
    with none arriving."""
    while True:
        try:
            message = messages.get(timeout=timeout)
        except queue.Empty:
            pytest.fail("no such message arrived")
        if check(message):
            return message
