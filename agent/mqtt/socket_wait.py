"""What the io thread waits on between its rounds: the connection's socket and a wake-up.

`SocketWait.wait` blocks in `select` until the socket can be read (where the caller watches
it for reading: not while a worker reads it, docs/decisions/0034), written (where a write
was left partial), a wake-up came, or the timeout passed. Any thread may `wake` it: one byte
on a socketpair, which never blocks (a full pair means a wake-up is already pending).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
from typing import Any

READ = selectors.EVENT_READ
WRITE = selectors.EVENT_WRITE


class SocketWait:
    """One per transport: `watch(sock)` for each connection, `wait`, `wake`, `close()`."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector: selectors.BaseSelector | None = None
        self._conn: Any = None
        self._watched = 0  # the events the socket is registered for (0: not registered)

    def watch(self, sock: Any) -> None:
        """Wait on `sock` (a new connection's) from now on, watched for reading."""
        self.unwatch()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, READ)
        self._conn = sock
        self._watched = 0
        self._set(READ)

    def unwatch(self) -> None:
        """Stop waiting on the connection's socket (it ended)."""
        if self._selector is not None:
            self._selector.close()
        self._selector, self._conn, self._watched = None, None, 0

    def wait(self, timeout: float, *, read: bool, write: bool) -> tuple[bool, bool]:
        """Block up to `timeout` seconds (0: only look) for the socket: readable where `read`,
        writable where `write`, or a wake-up. (readable, writable); a wake-up is consumed."""
        assert self._selector is not None  # `watch` first
        self._set((READ if read else 0) | (WRITE if write else 0))
        readable = writable = False
        for key, mask in self._selector.select(max(0.0, timeout)):
            if key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
                continue
            readable = readable or bool(mask & READ)
            writable = writable or bool(mask & WRITE)
        return readable, writable

    def wake(self) -> None:
        """Interrupt a `wait` (any thread; cheap, never blocks)."""
        with contextlib.suppress(OSError):  # full: a wake-up is already pending
            self._wake_w.send(b"\0")

    def close(self) -> None:
        self.unwatch()
        self._wake_r.close()
        self._wake_w.close()

    def _set(self, events: int) -> None:
        """Have the selector watch the socket for `events` (none: not at all)."""
        if events == self._watched:
            return
        assert self._selector is not None
        if not events:
            self._selector.unregister(self._conn)
        elif not self._watched:
            self._selector.register(self._conn, events)
        else:
            self._selector.modify(self._conn, events)
        self._watched = events
