"""A private Mosquitto process on a free loopback port: the demo's embedded broker.

The demo and the tests need a broker they own (to start, stop, kill and restart it, or to give
it TLS and passwords) without touching a system broker. Mosquitto is the broker edge boxes run,
so the agent is exercised against the real thing rather than an in-process imitation.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


class BrokerError(Exception):
    """Mosquitto could not be found or did not start."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_mosquitto() -> str:
    for candidate in (
        shutil.which("mosquitto"),
        "/usr/sbin/mosquitto",
        "/usr/local/sbin/mosquitto",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BrokerError(
        "the mosquitto binary was not found: install it (Debian/Ubuntu: "
        "sudo apt-get install mosquitto) or give a broker with --host/--port"
    )


class EmbeddedBroker:
    """Mosquitto with a generated config; `start`, `stop`, `kill`, `restart` keep the port.

    `extra_config` lines are appended to the generated `mosquitto.conf` (listeners for TLS,
    password files, persistence settings).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_config: Sequence[str] = (),
        persistence: bool = False,
        workdir: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="edge-agent-broker-"))
        self._extra = list(extra_config)
        self._persistence = persistence
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "mosquitto.log"

    def _write_config(self) -> Path:
        lines = [
            f"listener {self.port} 127.0.0.1",
            # Started as root, Mosquitto 2 drops to the `mosquitto` user, which cannot write
            # the log or the persistence file in this private folder; stay the caller.
            *(["user root"] if os.geteuid() == 0 else []),
            "allow_anonymous true",
            # Without it Nagle's algorithm holds small packets for the peer's delayed ACK.
            "set_tcp_nodelay true",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "max_inflight_messages 0",
            "max_queued_messages 100000",
        ]
        if self._persistence:
            lines += [
                "persistence true",
                f"persistence_location {self.workdir}/",
                "autosave_interval 1",
            ]
        config = self.workdir / "mosquitto.conf"
        config.write_text("\n".join(lines + self._extra) + "\n")
        return config

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        if self.running:
            return self
        config = self._write_config()
        self._process = subprocess.Popen(
            [find_mosquitto(), "-c", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = (
                    self._process.stderr.read().decode(errors="replace")
                    if self._process.stderr
                    else ""
                )
                log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                self._process = None
                raise BrokerError(f"mosquitto exited at start: {(err + log).strip()[-500:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise BrokerError(f"mosquitto did not listen on port {self.port} within {timeout:.0f} s")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """A clean stop (SIGTERM): Mosquitto saves its persistence file, if any."""
        self._end(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash, nothing saved since the last autosave."""
        self._end(signal.SIGKILL, 5.0)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _end(self, sig: signal.Signals, timeout: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stderr:
            process.stderr.close()

    def close(self) -> None:
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
