"""The queue between inference and the network, backed by the on-disk spool.

Inference never waits on a socket or a disk, and the socket never waits on inference: workers
put encoded messages here, the network thread takes them out in order and publishes them,
and the spool writer thread stores the QoS 1/2 ones meanwhile (write-behind, group commit;
see `agent.delivery.spool_writer`).

* QoS 1/2 messages that belong to a stream (replies, events) get a spool id when they are put
  and are written to the spool by the writer thread; they stay there until the broker
  acknowledged them. Memory holds only a window of them; when the window is full (a broker
  outage, a slow uplink) new ones go to disk only, and are read back in order once the
  publisher catches up. An outage therefore fills the disk (bounded by the spool's caps and
  policy), never an unbounded memory queue.
* QoS 0 messages and the connection's own status messages never touch the disk. When the
  memory bound is reached, workers block: back pressure reaches the scheduler, whose full
  queue answers `overloaded`. Nothing is dropped silently.
* Error replies produced on the network thread must never block it, so they may use a
  reserved headroom above the normal bound.
* Memory is bounded in payload bytes as well as in messages (`max_bytes`). Durable messages
  past it go to disk only; QoS 0 producers wait.
  Resends (the background lane) have their own byte cap, `background_bytes`: a resend that
  does not fit is not queued (the subscriber asks again), so a flood of asks for large
  messages cannot grow the process.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from agent.delivery.out_message import OutMessage
from agent.delivery.spool import Spool
from agent.delivery.spool_items import AfterWrite, Eviction, FinishRequest, SpooledMessage
from agent.delivery.spool_sql import stored_bytes
from agent.delivery.spool_writer import SpoolWriter

__all__ = ["OutMessage", "Outbox", "OutboxClosed"]

REFILL_BATCH = 256
MAX_BYTES = 64 * 1024 * 1024  # payload bytes queued in memory (live), by default
BACKGROUND_BYTES = 8 * 1024 * 1024  # payload bytes of resends queued, by default
Call = Callable[[], None]  # the transport's hooks (`set_on_queued`)


class OutboxClosed(Exception):
    """The agent is stopping; no more messages are taken."""


class Outbox:
    """`start()` (the spool writer), put from any thread, `take`/`get` from the publisher,
    `close()`."""

    def __init__(
        self,
        max_messages: int,
        reserve: int = 0,
        *,
        spool: Spool | None = None,
        on_eviction: Callable[[Eviction], None] | None = None,
        make_properties: Callable[[bytes], Any] | None = None,
        max_bytes: int = MAX_BYTES,
        background_bytes: int = BACKGROUND_BYTES,
    ) -> None:
        self._max = max_messages
        self._max_bytes = max_bytes
        self._background_max_bytes = background_bytes
        self._queued_bytes = 0  # payload bytes in `_queue`
        self._background_bytes = 0  # payload bytes in `_background`
        self._hard_max = max_messages + reserve
        self._queue: deque[OutMessage] = deque()
        self._background: deque[OutMessage] = deque()  # resends: after everything live
        self._lock = threading.Lock()  # taken directly on the hot paths: no Python frames
        self._cond = threading.Condition(self._lock)
        self._getting = 0  # `get()` callers waiting
        self._closed = False
        self._spool = spool
        self._make_properties = make_properties
        # Spooled messages with id <= _loaded_up_to are in memory (or published); the rest wait
        # on disk (or in the writer's queue) while `_spilling`.
        self._loaded_up_to = 0
        self._last_id = 0  # the newest spool id handed out
        self._spilling = spool is not None and spool.count > 0
        self._refill_asked = False
        self._generation = 0  # a rewind makes refills asked before it void
        self._unwritten = 0  # durable messages queued for the writer, not written yet
        self._unwritten_bytes = 0
        self._on_queued: Call = lambda: None
        self._wake: Call = lambda: None
        self._drive: Call = lambda: None
        self.rejected = 0  # reserved puts refused because even the headroom was full
        self.writer: SpoolWriter | None = None
        if spool is not None:
            self.writer = SpoolWriter(
                spool,
                protected_after=lambda: self._loaded_up_to,
                on_written=self._written,
                on_eviction=on_eviction,
                after_callbacks=self.kick,  # acknowledgements the callbacks queued
            )

    def start(self) -> None:
        if self.writer is not None:
            self.writer.start()

    def set_on_queued(
        self, on_queued: Call, wake: Call | None = None, drive: Call | None = None
    ) -> None:
        """`on_queued()` is called, outside the lock, on the thread that queued a message:
        the transport publishes it from there when its connection is free (no hand-off);
        `wake()` has its own thread publish instead (`hand_off`); `drive()`: see `kick`."""
        self._on_queued = on_queued
        self._wake = wake or on_queued
        self._drive = drive or on_queued

    def __len__(self) -> int:
        return len(self._queue) + len(self._background)

    @property
    def spooled(self) -> int:
        """Durable messages not acknowledged yet, on disk or on their way there."""
        if self._spool is None:
            return 0
        return self._spool.count + self._unwritten

    def _durable(self, message: OutMessage) -> bool:
        return self._spool is not None and message.qos > 0 and message.stream is not None

    # -- putting -------------------------------------------------------------------------------

    def put(self, message: OutMessage, timeout: float | None = None) -> None:
        """Queue a message. Blocks while memory (QoS 0), the spool (`reject_new`) or the spool
        writer is full. Raises OutboxClosed once closed, TimeoutError when `timeout` passes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._put_locked(message, deadline)
        self._on_queued()

    def put_many(self, messages: Sequence[OutMessage]) -> None:
        """`put` each, in order, in one round of the lock; blocks as `put` does. `kick` after."""
        with self._lock:
            for message in messages:
                self._put_locked(message, None)

    def put_many_now(self, messages: Sequence[OutMessage]) -> None:
        """`put_many` that never waits: for the thread that holds the connection (a short
        request run on it), which alone makes room, by publishing and by reading the
        acknowledgements. What it puts was sized by `has_room` before the run; other threads
        may have taken that room since, so the bounds and the spool's caps are passed by at
        most that much (the spool writes every batch it is given). Raises OutboxClosed."""
        with self._lock:
            if self._closed:
                raise OutboxClosed
            for message in messages:
                if self._durable(message):
                    self._put_durable(message, stored_bytes(message))
                else:
                    self._append_volatile(message)

    def _put_locked(self, message: OutMessage, deadline: float | None) -> None:
        durable = self._durable(message)
        size = stored_bytes(message) if durable else 0
        while True:
            if self._closed:
                raise OutboxClosed
            if durable:
                # The writer is not too far behind (else the disk is slower than the
                # producers: they wait for it), and the caps hold.
                if (
                    self._unwritten < self._max
                    and (self._unwritten_bytes < self._max_bytes or not self._unwritten)
                    and not self._caps_passed(size)
                ):
                    self._put_durable(message, size)
                    return
            elif len(self._queue) < self._max and (
                self._queued_bytes < self._max_bytes or not self._queue
            ):
                self._append_volatile(message)
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError("outbox full")
            if durable and self.writer is not None:
                self.writer.nudge(prompt=True)  # room comes from the writer (or from acks)
            self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))

    def kick(self, read: bool = False) -> None:
        """Have what `put_many` queued (or acknowledgements the spool writer's callbacks queued)
        published, from this thread if it can. `read`: a streaming worker's kick; the transport
        also reads the broker's answers on this thread (`drive`, docs/decisions/0034)."""
        (self._drive if read else self._on_queued)()

    def hand_off(self) -> None:
        """Have what `put_many` queued published by the transport's thread, not this one."""
        self._wake()

    def _caps_passed(self, size: int, messages: int = 1) -> bool:
        """Under the lock: (`reject_new`) `messages` more, of `size` stored bytes in all, would
        pass the spool's caps, counting everything queued for the writer."""
        assert self._spool is not None
        return self._spool.policy == "reject_new" and self._spool.full(
            self._unwritten + messages, self._unwritten_bytes + size
        )

    def _put_durable(self, message: OutMessage, size: int) -> None:
        """Under the lock, so the spool order and the memory order agree; `size`: its
        `stored_bytes`."""
        assert self._spool is not None and self.writer is not None
        message.spool_id = spool_id = self._spool.allocate_id()
        self._last_id = spool_id
        self._unwritten += 1
        self._unwritten_bytes += size
        self.writer.submit(message)
        if self._unwritten >= self._max // 2 or self._unwritten_bytes >= self._max_bytes // 2:
            self.writer.nudge(prompt=True)  # well before producers would have to wait for it
        if (
            not self._spilling
            and len(self._queue) < self._max
            and self._queued_bytes < self._max_bytes
        ):
            self._queue.append(message)
            self._queued_bytes += len(message.payload)
            self._loaded_up_to = spool_id
            self._notify()
        else:
            self._spilling = True  # on disk only; read back in order when the queue drains

    def _append_volatile(self, message: OutMessage) -> None:
        """A message that never touches the disk; if it finishes a stored request (a QoS 0
        reply to a QoS 1 request), the request is forgotten with the writer's next batch."""
        if message.finishes is not None and self.writer is not None:
            self.writer.submit(FinishRequest(message.finishes))
        self._queue.append(message)
        self._queued_bytes += len(message.payload)
        self._notify()

    def _notify(self) -> None:
        """Wake `get()` callers. The transport takes without waiting, so a message queued
        wakes nobody in the agent: no notify (a Python call per message) without a getter."""
        if self._getting:
            self._cond.notify_all()

    def has_room(self, messages: int, size: int) -> bool:
        """Whether `messages` more, of up to `size` stored bytes each, would be queued without
        waiting. The network thread runs a short request only then: it cannot wait for room
        that only it could make (by publishing, or by reading acknowledgements)."""
        with self._lock:
            if (
                self._closed
                or len(self._queue) + messages > self._max
                or self._queued_bytes + messages * size > self._max_bytes
            ):
                return False
            if self._spool is None:
                return True
            return self._unwritten + messages <= self._max and not self._caps_passed(
                messages * size, messages
            )

    def put_nowait_reserved(self, message: OutMessage) -> bool:
        """Never blocks: for the network thread. False (and counted) only when there is no
        room even in the headroom (or in the spool)."""
        with self._lock:
            if self._closed:
                self.rejected += 1
                return False
            if self._durable(message):
                size = stored_bytes(message)
                if self._caps_passed(size) or self._unwritten >= self._hard_max:
                    self.rejected += 1
                    return False
                self._put_durable(message, size)
            elif len(self._queue) >= self._hard_max or self._queued_bytes > 2 * self._max_bytes:
                self.rejected += 1
                return False
            else:
                self._append_volatile(message)
        self._on_queued()
        return True

    def put_background(self, message: OutMessage) -> bool:
        """A lane for resends: published only when nothing live waits, so a flood of resend
        requests cannot delay live streams; bounded in messages and in payload bytes (one
        message larger than the byte cap still goes when the lane is empty), never blocks,
        False when full."""
        size = len(message.payload)
        with self._cond:
            if (
                self._closed
                or len(self._background) >= self._max
                or (self._background and self._background_bytes + size > self._background_max_bytes)
            ):
                return False
            self._background.append(message)
            self._background_bytes += size
            self._notify()
        self._on_queued()
        return True

    def unget(self, message: OutMessage) -> None:
        """Put back at the front a message that could not be published (order is kept)."""
        with self._cond:
            self._queue.appendleft(message)
            self._queued_bytes += len(message.payload)
            self._notify()
        self._on_queued()

    # -- taking ----------------------------------------------------------------------------------

    def take(self, limit: int) -> list[OutMessage]:
        """Up to `limit` messages in order, without waiting (the publisher's call)."""
        with self._lock:
            queue = self._queue
            if not queue:
                if self._spilling:
                    self._ask_refill()
                if not self._background:
                    return []
                taken = [self._background.popleft()]
                self._background_bytes -= len(taken[0].payload)
            else:
                n = min(limit, len(queue))
                taken = [queue.popleft() for _ in range(n)]
                self._queued_bytes -= sum([len(m.payload) for m in taken])
                if self._spilling and len(queue) < self._max // 2:
                    self._ask_refill()
            self._cond.notify_all()  # room for blocked putters
            return taken

    def has_work(self) -> bool:
        """Whether a message waits (a refill still on its way does not count: it calls
        `on_queued` when it lands)."""
        return bool(self._queue or self._background)

    def get(self, timeout: float | None = None) -> OutMessage | None:
        """The oldest message, waiting up to `timeout`; None then, or once closed and empty."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._queue or self._background:
                    message = self._pop_locked()
                    if self._spilling and len(self._queue) < self._max // 2:
                        self._ask_refill()
                    self._cond.notify_all()
                    return message
                if self._spilling:
                    self._ask_refill()
                elif self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._getting += 1
                try:
                    self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))
                finally:
                    self._getting -= 1

    def _pop_locked(self) -> OutMessage:
        """Under the lock, with a message waiting: the oldest live one, else a resend."""
        if self._queue:
            message = self._queue.popleft()
            self._queued_bytes -= len(message.payload)
        else:
            message = self._background.popleft()
            self._background_bytes -= len(message.payload)
        return message

    def _ask_refill(self) -> None:
        """Under the lock: have the writer read the next spooled messages back into memory,
        in order, once everything queued before is on disk."""
        if self._refill_asked or self.writer is None:
            return
        room = max(0, min(REFILL_BATCH, self._max - len(self._queue)))
        if room == 0 or self._queued_bytes >= self._max_bytes:
            return
        self._refill_asked = True
        after, generation, last_id = self._loaded_up_to, self._generation, self._last_id

        def refill(spool: Spool) -> None:
            rows = spool.load_after(after, room)
            self._refilled(rows, after, generation, last_id, complete=len(rows) < room)

        self.writer.submit(AfterWrite(refill), urgent=True)

    def _refilled(
        self,
        rows: list[SpooledMessage],
        after: int,
        generation: int,
        last_id: int,
        *,
        complete: bool,
    ) -> None:
        with self._cond:
            self._refill_asked = False
            if generation != self._generation or after != self._loaded_up_to:
                self._cond.notify_all()
                return  # a rewind came in between: it starts over
            for row in rows:
                self._queue.append(row.message(self._make_properties))
                self._queued_bytes += len(row.payload)
                self._loaded_up_to = row.id
            # Read to the end, and nothing was spooled since the refill was asked: caught up.
            if complete and self._last_id == last_id:
                self._spilling = False
            elif not rows:
                self._ask_refill()  # what was spooled meanwhile is queued behind this refill
            self._notify()
        if rows:
            self._on_queued()

    def _written(self, messages: int, size: int) -> None:
        """The writer stored a batch: room for putters waiting on it."""
        with self._cond:
            self._unwritten -= messages
            self._unwritten_bytes -= size
            self._cond.notify_all()

    # -- acknowledgements ----------------------------------------------------------------------

    def acknowledged(self, spool_id: int) -> None:
        """The broker has it; the spool marks it with the writer's next batch."""
        if self.writer is not None:
            self.writer.ack(spool_id)

    def forget(self, spool_id: int) -> None:
        """Drop a spooled message for good (quarantined: the broker refuses it, or it kills
        the connection): deleted by the writer after its own row is written, never marked
        acknowledged, so neither a reconnect nor a resend publishes it again."""
        if self.writer is not None:

            def forget(spool: Spool) -> None:
                spool.forget((spool_id,))

            self.writer.submit(AfterWrite(forget))
            self.writer.nudge()

    @property
    def queued_bytes(self) -> int:
        """Payload bytes queued in memory: live messages and resends."""
        return self._queued_bytes + self._background_bytes

    def flush_acks(self, timeout: float = 30.0) -> bool:
        """Wait until every queued message and acknowledgement is written."""
        return self.writer.flush(timeout) if self.writer is not None else True

    def rewind(self, unack_since: float | None = None) -> int:
        """Before a new connection: read every pending spooled message back from disk, in
        order, and (with `unack_since`) also those the broker acknowledged since then: a
        broker acknowledges before it saves, so after its crash they are published again
        (subscribers drop duplicates by (id, seq)). Durable messages in memory are dropped
        and re-read, so the order holds. Returns the number of pending spooled messages."""
        if self._spool is None:
            return 0
        self.flush_acks()  # what the old connection published and got acknowledged is settled
        with self._cond:
            if unack_since is not None:
                self._spool.unack_since(unack_since)
            self._queue = deque(m for m in self._queue if m.spool_id is None)
            self._queued_bytes = sum(len(m.payload) for m in self._queue)
            self._loaded_up_to = 0
            self._generation += 1
            self._refill_asked = False
            self._spilling = self.spooled > 0
            self._cond.notify_all()
            return self.spooled

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
                if self._spilling and not self._queue:
                    self._ask_refill()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
            return True

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking messages (`get` still drains what is queued in memory); write what the
        spool writer holds and stop it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self.writer is not None:
            self.writer.close(timeout)
