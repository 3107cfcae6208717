"""The queue between inference and the network, backed by the on-disk spool.

Inference never waits on a socket and the socket never waits on inference: workers put
encoded messages here and the transport's single publisher takes them out in order.

* QoS 1/2 messages that belong to a stream (replies, events) are written to the spool first
  and stay there until the broker acknowledged them. Memory holds only a window of them; when
  the window is full (a broker outage, a slow uplink) new ones go to disk only, and the
  publisher reads them back in order once it catches up. An outage therefore fills the disk
  (bounded by the spool's caps and policy), never an unbounded memory queue.
* QoS 0 messages and the connection's own status messages never touch the disk. When the
  memory bound is reached, workers block: back pressure reaches the scheduler, whose full
  queue answers `overloaded`. Nothing is dropped silently.
* Error replies produced on the network thread must never block it, so they may use a
  reserved headroom above the normal bound.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.spool import Eviction, Spool, SpoolFull

REFILL_BATCH = 256


@dataclass(frozen=True)
class OutMessage:
    """One MQTT publish, fully encoded; `properties` is a paho `Properties` (MQTT 5) or None.

    `stream` names the stream a QoS 1/2 message belongs to (spooled when set); `finishes` is
    the key of the stored request this message answers for the last time; `spool_id` is set
    once the message is on disk.
    """

    topic: str
    payload: bytes
    qos: int
    retain: bool = False
    properties: Any = None
    stream: str | None = None
    finishes: str | None = None
    spool_id: int | None = None
    correlation: bytes | None = None
    rid: str | None = None  # the reply stream's id and seq, for application-level resend
    seq: int | None = None


class OutboxClosed(Exception):
    """The agent is stopping; no more messages are taken."""


class Outbox:
    def __init__(
        self,
        max_messages: int,
        reserve: int = 0,
        *,
        spool: Spool | None = None,
        on_eviction: Callable[[Eviction], None] | None = None,
        make_properties: Callable[[bytes], Any] | None = None,
    ) -> None:
        self._max = max_messages
        self._hard_max = max_messages + reserve
        self._queue: deque[OutMessage] = deque()
        self._background: deque[OutMessage] = deque()  # resends: after everything live
        self._cond = threading.Condition()
        self._closed = False
        self._spool = spool
        self._on_eviction = on_eviction
        self._make_properties = make_properties
        # Spooled messages with id <= _loaded_up_to are in memory (or published); the rest wait
        # on disk while `_spilling`.
        self._loaded_up_to = 0
        self._spilling = spool is not None and spool.count > 0
        self._acked: list[int] = []
        self._acked_lock = threading.Lock()
        self.rejected = 0  # reserved puts refused because even the headroom was full

    def __len__(self) -> int:
        return len(self._queue) + len(self._background)

    def put_background(self, message: OutMessage) -> bool:
        """A lane for resends: published only when nothing live waits, so a flood of resend
        requests cannot delay live streams; bounded, never blocks, False when full."""
        with self._cond:
            if self._closed or len(self._background) >= self._max:
                return False
            self._background.append(message)
            self._cond.notify_all()
            return True

    @property
    def spooled(self) -> int:
        return self._spool.count if self._spool is not None else 0

    def _durable(self, message: OutMessage) -> bool:
        return self._spool is not None and message.qos > 0 and message.stream is not None

    # -- putting -------------------------------------------------------------------------------

    def put(self, message: OutMessage, timeout: float | None = None) -> None:
        """Queue a message. Blocks while memory (QoS 0) or the spool (`reject_new`) is full.

        Raises OutboxClosed once closed, TimeoutError when `timeout` passes first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        durable = self._durable(message)
        with self._cond:
            while not self._closed:
                if durable:
                    try:
                        self._put_durable(message)
                        return
                    except SpoolFull:
                        pass  # wait for acknowledgements to make room
                elif len(self._queue) < self._max:
                    self._append_volatile(message)
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("outbox full")
                self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))
            raise OutboxClosed

    def _put_durable(self, message: OutMessage) -> None:
        """Under the condition's lock, so the spool order and the memory order agree."""
        assert self._spool is not None and message.stream is not None
        spool_id, eviction = self._spool.add(
            message.stream,
            message.topic,
            message.payload,
            message.qos,
            message.retain,
            message.correlation,
            finishes=message.finishes,
            protected_after=self._loaded_up_to,
            rid=message.rid,
            seq=message.seq,
        )
        if eviction is not None and self._on_eviction is not None:
            self._on_eviction(eviction)
        if not self._spilling and len(self._queue) < self._max:
            self._queue.append(dataclasses.replace(message, spool_id=spool_id))
            self._loaded_up_to = spool_id
            self._cond.notify_all()
        else:
            self._spilling = True  # on disk only; `get` reads it back in order
            self._cond.notify_all()

    def _append_volatile(self, message: OutMessage) -> None:
        """A message that never touches the disk; if it finishes a stored request (a QoS 0
        reply to a QoS 1 request), the request is forgotten now."""
        if message.finishes is not None and self._spool is not None:
            self._spool.finish_request(message.finishes)
        self._queue.append(message)
        self._cond.notify_all()

    def put_nowait_reserved(self, message: OutMessage) -> bool:
        """Never blocks: for the network thread. False (and counted) only when there is no
        room even in the headroom (or in the spool)."""
        with self._cond:
            if self._closed:
                self.rejected += 1
                return False
            if self._durable(message):
                try:
                    self._put_durable(message)
                    return True
                except SpoolFull:
                    self.rejected += 1
                    return False
            if len(self._queue) >= self._hard_max:
                self.rejected += 1
                return False
            self._append_volatile(message)
            return True

    def unget(self, message: OutMessage) -> None:
        """Put back at the front a message that could not be published (order is kept)."""
        with self._cond:
            self._queue.appendleft(message)
            self._cond.notify_all()

    # -- taking ----------------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> OutMessage | None:
        """The oldest message, or None after `timeout` or once closed and empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                if self._spilling:
                    self._refill()
                    if self._queue:
                        break
                if self._background:
                    message = self._background.popleft()
                    self._cond.notify_all()
                    return message
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            message = self._queue.popleft()
            if self._spilling and len(self._queue) < self._max // 2:
                self._refill()
            self._cond.notify_all()
            return message

    def _refill(self) -> None:
        """Read the next spooled messages back into memory, in order."""
        assert self._spool is not None
        room = max(0, min(REFILL_BATCH, self._max - len(self._queue)))
        if room == 0:
            return
        rows = self._spool.load_after(self._loaded_up_to, room)
        for row in rows:
            properties = (
                self._make_properties(row.correlation)
                if row.correlation is not None and self._make_properties is not None
                else None
            )
            self._queue.append(
                OutMessage(
                    row.topic,
                    row.payload,
                    row.qos,
                    row.retain,
                    properties,
                    stream=row.stream,
                    spool_id=row.id,
                    correlation=row.correlation,
                )
            )
            self._loaded_up_to = row.id
        if len(rows) < room:
            self._spilling = False

    # -- acknowledgements ----------------------------------------------------------------------

    def acknowledged(self, spool_id: int) -> None:
        """The broker has it; the spool forgets it at the next `flush_acks` (batched)."""
        with self._acked_lock:
            self._acked.append(spool_id)

    def flush_acks(self) -> int:
        """Delete acknowledged messages from the spool; wakes writers waiting for room."""
        with self._acked_lock:
            ids, self._acked = self._acked, []
        if ids and self._spool is not None:
            self._spool.ack(ids)
            with self._cond:
                self._cond.notify_all()
        return len(ids)

    def rewind(self, unack_since: float | None = None) -> int:
        """Before a new connection: read every pending spooled message back from disk, in
        order, and (with `unack_since`) also those the broker acknowledged since then.

        A broker acknowledges before it saves: after a crash, its last acknowledged messages
        may be gone, so they are published again; subscribers drop duplicates by (id, seq).
        Durable messages in memory are dropped and re-read, so the order holds. Returns the
        number of pending spooled messages.
        """
        if self._spool is None:
            return 0
        self.flush_acks()  # what the old connection got acknowledged is settled first
        with self._cond:
            if unack_since is not None:
                self._spool.unack_since(unack_since)
            self._queue = deque(m for m in self._queue if m.spool_id is None)
            self._loaded_up_to = 0
            self._spilling = self._spool.count > 0
            self._cond.notify_all()
            return self._spool.count

    def expire(self) -> int:
        if self._spool is None:
            return 0
        with self._cond:
            return self._spool.expire(self._loaded_up_to)

    # -- stop ------------------------------------------------------------------------------------

    def wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._spilling:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
            return True

    def close(self) -> None:
        """Stop taking messages; `get` still drains what is queued in memory."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
