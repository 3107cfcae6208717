"""The bounded queue between inference and the network.

Inference never waits on a socket and the socket never waits on inference: workers put
encoded messages here and the transport's single publisher takes them out. When the outbox is
full, workers block (back pressure reaches the scheduler, whose queue then fills and answers
`overloaded`); nothing is ever dropped silently. Error replies produced while decoding requests
on the network thread must never block that thread, so they may use a reserved headroom above
the normal bound.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OutMessage:
    """One MQTT publish, fully encoded; `properties` is a paho `Properties` (MQTT 5) or None."""

    topic: str
    payload: bytes
    qos: int
    retain: bool = False
    properties: Any = None


class OutboxClosed(Exception):
    """The agent is stopping; no more messages are taken."""


class Outbox:
    def __init__(self, max_messages: int, reserve: int = 0) -> None:
        self._max = max_messages
        self._hard_max = max_messages + reserve
        self._queue: deque[OutMessage] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.rejected = 0  # reserved puts refused because even the headroom was full

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, message: OutMessage, timeout: float | None = None) -> None:
        """Block until there is room (back pressure). Raise OutboxClosed or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._queue) >= self._max and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("outbox full")
                self._cond.wait(remaining)
            if self._closed:
                raise OutboxClosed
            self._queue.append(message)
            self._cond.notify_all()

    def put_nowait_reserved(self, message: OutMessage) -> bool:
        """Never blocks: for the network thread. False (and counted) only past the headroom."""
        with self._cond:
            if self._closed or len(self._queue) >= self._hard_max:
                self.rejected += 1
                return False
            self._queue.append(message)
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None = None) -> OutMessage | None:
        """The oldest message, or None after `timeout` or once closed and empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            message = self._queue.popleft()
            self._cond.notify_all()
            return message

    def unget(self, message: OutMessage) -> None:
        """Put back at the front a message that could not be published (order is kept)."""
        with self._cond:
            self._queue.appendleft(message)
            self._cond.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self) -> None:
        """Stop taking messages; `get` still drains what is queued."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
