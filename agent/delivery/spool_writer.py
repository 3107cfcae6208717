"""The one thread that writes the spool: group commit, off every latency path.

Workers queue messages, the network thread queues request stores and acknowledgements; this
thread takes everything that arrived since its last wake-up and writes it as one transaction
(`Spool.write`), in the order it was queued. It is woken when a request's replies are out (or
a batch run ended, or a producer would have to wait for it, or on a housekeeping tick), never
on a request's own path, and then waits out GROUP_COMMIT_S (STREAM_COMMIT_S for a batch of
messages alone: a stream's replies). Nobody waits for it except where
the contract says so: a request is acknowledged to the broker only from `on_stored`, after
the fsync (or, for a request already answered with every reply acknowledged, after the
commit: it needs nothing on disk any more). A request stored moments ago and still running
waits for the next batch rather than cost this one an fsync (`spool.settled_prefix`).

Messages are published from memory while they are being written (write-behind). A message
published and lost before its row is committed is one the agent crashed with: a request
stream is then regenerated from the stored request (it is deleted only by the transaction
that writes its terminal message, after every earlier message of the stream); the rest
(events, live source frames) was in flight anyway.

A batch that cannot be written (the disk is full, an I/O error) is not dropped: its request
stores fail at once (`StoreRequest.on_failed`: the ingress answers `overloaded`), everything
else (messages, acknowledgements, callbacks) goes back to the front of the queue and is
written again every RETRY_S, together with what arrived meanwhile, until a write succeeds.
Meanwhile `problem` says why (for `/healthz`); the messages stay in memory and are published
from there, bounded by the outbox, whose producers wait once the writer is that far behind.
"""

from __future__ import annotations

import errno
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable

from agent.delivery.spool import Spool
from agent.delivery.spool_items import (
    AfterWrite,
    Eviction,
    StoreRequest,
    WriteItem,
    settled_prefix,
    unacknowledged_tail,
)
from agent.threads import NamedThread

log = logging.getLogger(__name__)

# A batch is written this long after its first item (unless someone waits for it, or it is
# large): the writes gather, and the broker usually acknowledges a message before it is
# written, so it is written once, as acknowledged, instead of written and then updated.
GROUP_COMMIT_S = 0.005
URGENT_ITEMS = 512  # a batch this large is written at once
# A batch of messages alone (a stream's replies: no request stored, nobody waiting for a
# callback) is written this long after its first item, or once it holds STREAM_ITEMS: a fast
# stream costs the writer a few large batches a second instead of one every few milliseconds,
# each a round of GIL hand-offs with the worker (docs/decisions/0029). A crash loses no more:
# the request of a stream whose rows were not written is still stored and runs again.
STREAM_COMMIT_S = 0.1
STREAM_ITEMS = 2048
ACK_FLUSH_S = 0.02  # acknowledgements alone wake the writer at most this late
# A request stored less than this long ago and not settled yet (see `settled_prefix`) waits for
# the next batch instead of costing this one an fsync; older ones are fsynced at once.
SETTLE_GRACE_S = GROUP_COMMIT_S
# The newest messages of a batch the broker has not acknowledged yet (at most this many) wait
# for the next batch, once (see `unacknowledged_tail`): a fast stream's rows are then written
# once, as acknowledged, not inserted and marked later (docs/decisions/0029).
IN_FLIGHT_TAIL = 256
RETRY_S = 0.5  # after a failed write (disk full, I/O error)
FAILURE_LOG_S = 30.0  # a failing disk is logged again at most this often
FLUSH_FAILING_S = 5 * RETRY_S  # how long `flush` waits for a disk that fails
SQLITE_FULL = 13
DISK_FULL = "the agent's disk is full"


class SpoolWriter:
    """`start()`, `submit()`/`ack()` from any thread, `flush()` to wait, `close()`."""

    def __init__(
        self,
        spool: Spool,
        *,
        protected_after: Callable[[], int],
        on_written: Callable[[int, int], None],
        on_eviction: Callable[[Eviction], None] | None = None,
        after_callbacks: Callable[[], None] = lambda: None,
    ) -> None:
        """`protected_after()`: the highest message id held in memory for publishing (never
        evicted); `on_written(messages, bytes)`: after each batch, to release back pressure;
        `after_callbacks()`: once after a batch's `on_stored` and `AfterWrite` callbacks ran
        (they queue acknowledgements: one publishing round for all of them, not one each)."""
        self.spool = spool
        self._protected_after = protected_after
        self._on_written = on_written
        self._on_eviction = on_eviction
        self._after_callbacks = after_callbacks
        self._lock = threading.Lock()  # taken directly on the hot paths: no Python frames
        self._cond = threading.Condition(self._lock)
        self._items: list[WriteItem] = []
        self._acks: list[int] = []
        self._first_ack_at = 0.0
        self._first_item_at = 0.0
        self._prompt = False  # a queued item stores a request or waits to run (GROUP_COMMIT_S)
        self._urgent = False  # someone waits: write without the group-commit delay
        self._notified = False  # the writer was woken for the items it holds
        self._submitted = 0
        self._written = 0  # items written so far (submission count reached)
        self._closing = False
        self._held_up_to = 0  # the newest message id held back by `unacknowledged_tail`
        self.failures = 0  # batches that could not be written
        self.failed_stores = 0  # requests not stored because their batch failed
        # Why the last write failed (`disk_problem`), None once a write succeeds again.
        self.problem: str | None = None
        self._retry_at = 0.0
        self._failure_logged = -FAILURE_LOG_S
        self._thread = NamedThread(target=self._run, name="spool-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Items queued and not written yet."""
        return self._submitted - self._written

    def submit(self, item: WriteItem, *, urgent: bool = False) -> None:
        """Queue an item. The writer is not woken for it: `nudge()` does that once the work
        that queued it is done (a request answered, a batch run, a housekeeping tick), so a
        request's own path never waits for this thread to take the GIL. `urgent`: somebody
        waits for it (a refill of the publisher, a flush)."""
        with self._lock:
            self._items.append(item)
            self._submitted += 1
            if len(self._items) == 1:
                self._first_item_at = time.monotonic()
            if not self._prompt and isinstance(item, (StoreRequest, AfterWrite)):
                self._prompt = True
            if urgent:
                self._urgent = True
            if urgent or len(self._items) == URGENT_ITEMS:
                self._notified = True
                self._cond.notify()

    def nudge(self, *, prompt: bool = False) -> None:
        """Wake the writer for what was queued since its last batch (it still waits out the
        group-commit delay). `prompt`: producers (are about to) wait for room only the writer
        makes: GROUP_COMMIT_S, even for a batch of messages alone."""
        with self._lock:
            if prompt and self._items and not self._prompt:
                self._prompt = True
                self._notified = True
                self._cond.notify()
            elif (self._items or self._acks) and not self._notified:
                self._notified = True
                self._cond.notify()

    def ack(self, spool_id: int) -> None:
        """The broker acknowledged this message: marked with the next batch, or within
        ACK_FLUSH_S (the writer looks while unacknowledged rows exist; no wake-up here)."""
        with self._lock:
            self._acks.append(spool_id)
            if len(self._acks) == 1:
                self._first_ack_at = time.monotonic()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted (and acknowledged) before this call is written."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._acks:  # a marker, so the acknowledgements get their turn now
                self._items.append(AfterWrite(_nothing))
                self._submitted += 1
            target = self._submitted
            self._urgent = True
            self._cond.notify_all()
            failing_since: float | None = None
            while self._written < target:
                now = time.monotonic()
                if self.problem is not None and failing_since is None:
                    # A failing disk: wait a few retries (an I/O error may pass), not the
                    # whole timeout (a full disk does not; a reconnect or stop must go on).
                    failing_since = now
                    deadline = min(deadline, now + FLUSH_FAILING_S)
                remaining = deadline - now
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(remaining, 0.1))
            return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if now < self._retry_at and not self._closing:
                        self._cond.wait(self._retry_at - now)  # the last write failed
                        continue
                    if self._items:
                        prompt = self._prompt
                        due = self._first_item_at + (GROUP_COMMIT_S if prompt else STREAM_COMMIT_S)
                        if (
                            self._urgent
                            or self._closing
                            or len(self._items) >= (URGENT_ITEMS if prompt else STREAM_ITEMS)
                        ):
                            break
                    elif self._acks:
                        due = self._first_ack_at + ACK_FLUSH_S
                    elif self._closing:
                        return
                    elif self.problem is not None:
                        break  # writes fail and nothing is queued: probe the disk
                    else:
                        # Rows waiting for their acknowledgement: look again in a while.
                        self._cond.wait(ACK_FLUSH_S if self.spool.count else None)
                        continue
                    if now >= due:
                        break
                    self._cond.wait(due - now)
                hurry = self._urgent or self._closing
                self._urgent = False
                self._notified = False
                acks, self._acks = self._acks, []  # first: each refers to a message queued before
                items, self._items = self._items, []
                self._prompt = False
                reached = self._submitted
                if not hurry:  # nobody waits: a young unsettled request may wait for the next
                    cut = settled_prefix(items, acks, time.monotonic(), SETTLE_GRACE_S)
                    if cut == len(items):  # and so may messages still in flight
                        cut = unacknowledged_tail(items, acks, self._held_up_to, IN_FLIGHT_TAIL)
                    if cut < len(items):
                        items, acks = self._hold_back(items, acks, cut)
                        reached -= len(self._items)
            if (items or acks) and not self._write(items, acks):
                if self._put_back(items, acks):
                    return  # closing, and the disk still fails
                continue
            if not (items or acks) and self.problem is not None:
                self._probe()
                continue
            with self._cond:
                self._written = reached
                self._cond.notify_all()

    def _hold_back(
        self, items: list[WriteItem], acks: list[int], cut: int
    ) -> tuple[list[WriteItem], list[int]]:
        """Under the lock, with nothing else queued: `items[cut:]` (and the acknowledgements of
        their messages) go back to the queue for the next batch; the rest is returned."""
        later = items[cut:]
        ids = {i for i in (getattr(item, "spool_id", None) for item in later) if i is not None}
        self._items = later
        self._acks = [spool_id for spool_id in acks if spool_id in ids]
        self._held_up_to = max(ids, default=self._held_up_to)
        self._first_item_at = time.monotonic()
        self._prompt = any(isinstance(item, (StoreRequest, AfterWrite)) for item in later)
        return items[:cut], [spool_id for spool_id in acks if spool_id not in ids]

    def _write(self, items: list[WriteItem], acks: list[int]) -> bool:
        """Write a batch and run its callbacks; False when it failed (`_put_back` then)."""
        try:
            result = self.spool.write(items, acks, self._protected_after())
        except (sqlite3.Error, OSError) as e:
            self._failed(e, len(items))
            return False
        if self.problem is not None:
            log.warning(
                "spool: writes succeed again (after %d failed batch(es)): %s",
                self.failures,
                self.problem,
            )
            self.problem = None
        self._on_written(result.written, result.written_bytes)
        if result.eviction is not None and self._on_eviction is not None:
            self._on_eviction(result.eviction)
        for callback in result.stored:
            _safely(callback)
        for after in result.after:
            _safely(lambda after=after: after(self.spool))  # type: ignore[misc]
        if result.stored or result.after:
            _safely(self._after_callbacks)
        return True

    def _probe(self) -> None:
        """While writes fail and nothing is queued: a small write tells when the disk has room
        again (so `/healthz` and the ingress do not wait for the next request to find out)."""
        try:
            self.spool.probe()
        except (sqlite3.Error, OSError) as e:
            self._failed(e, 0)
            with self._cond:
                self._retry_at = time.monotonic() + RETRY_S
            return
        log.warning("spool: writes succeed again (after %d failure(s))", self.failures)
        self.problem = None

    def _failed(self, error: BaseException, items: int) -> None:
        self.failures += 1
        self.problem = failure_reason(error)
        now = time.monotonic()
        if now - self._failure_logged >= FAILURE_LOG_S:
            self._failure_logged = now
            log.error(
                "spool: writing %d item(s) failed (%d time(s) so far; retrying every %g s;"
                " requests get `overloaded` meanwhile): %s",
                items,
                self.failures,
                RETRY_S,
                error,
            )

    def _put_back(self, items: list[WriteItem], acks: list[int]) -> bool:
        """After a failed write: the batch's request stores fail (`on_failed`), the rest goes
        back to the front of the queue, tried again after RETRY_S. True when closing: then
        nothing more is tried, and what was not written is dropped."""
        stores = [item for item in items if isinstance(item, StoreRequest)]
        kept: list[WriteItem] = [item for item in items if not isinstance(item, StoreRequest)]
        self.spool.request_keys.difference_update(item.key for item in stores)
        self.failed_stores += len(stores)
        with self._cond:
            closing = self._closing
            if closing:
                log.error("spool: stopping with %d item(s) not written", len(kept) + len(acks))
                self._items, self._acks = [], []
            else:
                self._items = kept + self._items
                self._prompt = True  # tried again after RETRY_S, not STREAM_COMMIT_S
                self._acks = acks + self._acks
                self._first_item_at = self._first_ack_at = time.monotonic()
                self._retry_at = time.monotonic() + RETRY_S
            self._written = self._submitted - len(self._items)
            self._cond.notify_all()
        reason = self.problem or DISK_FULL
        for store in stores:
            if store.on_failed is not None:
                _safely(functools.partial(store.on_failed, reason))
        if stores:
            _safely(self._after_callbacks)
        return closing


def failure_reason(error: BaseException) -> str:
    """What a failed write tells an operator (and a requester, in `overloaded`)."""
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    if isinstance(error, sqlite3.Error):
        code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
        full = code == SQLITE_FULL or "full" in str(error).lower()
    if full:
        return DISK_FULL
    return f"the agent cannot write its spool: {str(error)[:200]}"


def _nothing(spool: Spool) -> None:
    """The marker `flush` queues so that waiting acknowledgements are written now."""


def _safely(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        log.exception("spool: a callback after a write failed")
