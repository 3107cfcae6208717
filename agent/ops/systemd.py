"""systemd integration: sd_notify over `$NOTIFY_SOCKET`, the watchdog, credentials.

Hand-written rather than a library: the notify protocol is one datagram of `KEY=VALUE` lines
sent to an AF_UNIX socket, and systemd documents that protocol (not libsystemd) as the stable
interface, with a reference reimplementation in sd_notify(3). A binding (python-systemd)
would need libsystemd headers and a C build on every aarch64 box for about 40 lines of code.

Everything here is a no-op outside systemd: without `$NOTIFY_SOCKET` nothing is sent, and a
failing send is logged once, never raised (a daemon must not die because its supervisor's
socket went away).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"
# While waiting for the broker at start-up, each healthy tick pushes the start timeout this
# far out (EXTEND_TIMEOUT_USEC): an unreachable broker leaves the unit "activating" with a
# STATUS line, instead of a restart loop that cannot help.
EXTEND_TIMEOUT_S = 60.0


def socket_address(value: str | None) -> str | bytes | None:
    """The sendto() address of `$NOTIFY_SOCKET`: a path, or '@name' for the abstract namespace."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # vsock: (VMs) and relative paths are not for a daemon on an edge box.
    log.warning("sd_notify: unsupported NOTIFY_SOCKET %r, notifications disabled", value[:100])
    return None


def watchdog_usec(environ: Mapping[str, str]) -> int | None:
    """`$WATCHDOG_USEC` when it is meant for this process (`$WATCHDOG_PID` unset or ours)."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid.strip() != str(os.getpid())):
        return None
    return usec


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in µs, as RELOADING=1 wants it in MONOTONIC_USEC (systemd >= 253)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends sd_notify messages. Thread-safe; `close()` releases the socket."""

    def __init__(self, address: str | bytes | None, *, watchdog_usec: int | None = None) -> None:
        self._address = address
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._warned = False
        self.watchdog_s = watchdog_usec / 1e6 if watchdog_usec else None

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = False
    ) -> Notifier:
        """Read `$NOTIFY_SOCKET` and `$WATCHDOG_USEC`; `unset` hides them from child processes."""
        env = os.environ if environ is None else environ
        notifier = cls(socket_address(env.get("NOTIFY_SOCKET")), watchdog_usec=watchdog_usec(env))
        if unset:
            for name in NOTIFY_ENV:
                env.pop(name, None)
        return notifier

    @classmethod
    def disabled(cls) -> Notifier:
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send one datagram of `KEY=VALUE` fields; False when disabled or the send failed."""
        if self._address is None or not fields:
            return False
        data = "\n".join(fields).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.sendto(data, self._address)
            except OSError as e:
                if not self._warned:
                    log.warning("sd_notify: cannot send to the notify socket: %s", e)
                    self._warned = True
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", *_status(status))

    def extend_timeout(self, seconds: float) -> bool:
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _status(text: str | None) -> tuple[str, ...]:
    # A newline would start a new field: STATUS is one line.
    return () if text is None else (f"STATUS={' '.join(text.split())[:400]}",)


class ServiceReporter:
    """What the housekeeping thread tells systemd on each tick, and when.

    READY=1 once (the broker is connected and the models are loaded and warm); WATCHDOG=1
    every third of `WatchdogSec` but only while the agent reports itself healthy, so a stuck
    worker or a dead network loop stops the pings and systemd restarts the service; STATUS=
    whenever the one-line summary changes.
    """

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.ready_sent = False
        self._last_ping = 0.0
        self._last_extend = 0.0
        self._last_status: str | None = None
        self._unhealthy: str | None = None

    @property
    def ping_interval_s(self) -> float | None:
        watchdog = self.notifier.watchdog_s
        return None if watchdog is None else watchdog / 3

    def tick(self, *, ready: bool, problem: str | None, status: str) -> None:
        """`problem` is None while healthy; `status` is the one-line summary."""
        now = time.monotonic()
        if problem is not None:
            status = f"unhealthy: {problem}"
            if self._unhealthy != problem:
                log.error("health: %s (withholding watchdog pings)", problem)
            self._unhealthy = problem
        elif self._unhealthy is not None:
            log.info("health: recovered")
            self._unhealthy = None
        if not self.ready_sent:
            if ready and problem is None:
                self.ready_sent = True
                self._last_status = status
                self.notifier.ready(status)
                self._ping(now)
                return
            if problem is None and now - self._last_extend >= EXTEND_TIMEOUT_S / 4:
                self._last_extend = now
                self.notifier.extend_timeout(EXTEND_TIMEOUT_S)
        elif problem is None and now - self._last_ping >= (self.ping_interval_s or 1e9):
            self._ping(now)
        if status != self._last_status:
            self._last_status = status
            self.notifier.status(status)

    def _ping(self, now: float) -> None:
        if self.notifier.watchdog_s is not None:
            self._last_ping = now
            self.notifier.watchdog()


def credential_path(path: Path, environ: Mapping[str, str]) -> Path | None:
    """A relative secret path names a systemd credential when `$CREDENTIALS_DIRECTORY` has it.

    `LoadCredential=mqtt-password:/etc/edge-agent/mqtt-password` puts the file at
    `$CREDENTIALS_DIRECTORY/mqtt-password`, readable by the service user only; the config
    then says `password_file = "mqtt-password"`. Outside systemd (no such variable, or no such
    file there) the path resolves against the config file's folder as every other path does.
    """
    directory = environ.get(CREDENTIALS_ENV)
    if not directory or path.is_absolute() or str(path).startswith("~"):
        return None
    candidate = Path(directory) / path
    return candidate if candidate.is_file() else None
