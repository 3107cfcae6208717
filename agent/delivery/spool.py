"""The on-disk spool: QoS 1/2 messages until the broker acknowledged them, and requests until
they got their terminal message. SQLite in WAL mode, one file under `state_dir`.

Why SQLite: it is in the standard library, crash-safe (a SIGKILL or power cut leaves the last
committed state, never a torn file), and an ordered table with a primary key is exactly a
durable FIFO.

One thread writes it (`agent.delivery.spool_writer.SpoolWriter`), in batches: every wake-up of that
thread is one transaction holding all the messages, request stores, request deletions and
acknowledgements that arrived since the last one (group commit). A commit that holds a
request store is made with `synchronous=FULL` (an fsync: the request is acknowledged to the
broker only after it); the others with `synchronous=NORMAL` (no fsync: they survive a crash of
the process; after a power cut the lost tail is regenerated, because the request whose
terminal message was lost is still stored and runs again; WAL order makes that safe, a later
transaction is never on disk without the earlier ones).

Message ids are handed out in memory (`allocate_id`), in the order messages are queued, so the
publisher and the disk agree on the order before a row is written.

The spool is four modules: this one (the `Spool`: opening, writing batches, the caps and
eviction, expiry, stored requests), `spool_history` (acknowledged messages kept for resend),
`spool_items` (what is written and read back, and the rule that decides a commit's fsync),
and `spool_sql` (the schema and the statements).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agent.delivery.spool_history import SpoolHistory
from agent.delivery.spool_items import (
    AfterWrite,
    Eviction,
    FinishRequest,
    SpooledMessage,
    StoredRequest,
    StoreRequest,
    WriteItem,
    settlement,
)
from agent.delivery.spool_open import Quarantine, open_checked
from agent.delivery.spool_sql import (
    DELETE_REQUESTS,
    DELETE_REQUESTS_SQL,
    INSERT_REQUESTS,
    INSERT_REQUESTS_SQL,
    INSERT_ROWS,
    INSERT_SQL,
    SUM_STORED,
    connect,
    pieces,
    prepare,
    stored_bytes,
)

log = logging.getLogger(__name__)

Policy = Literal["reject_new", "drop_oldest"]
PROBE_KEY = "\x00probe"  # no request key looks like it (model names and ids are checked)


class SpoolFull(Exception):
    """No room for the message under the `reject_new` policy (or nothing left to evict)."""


@dataclass
class WriteResult:
    written: int = 0  # messages
    written_bytes: int = 0
    stored: list[Callable[[], None]] = field(default_factory=list)  # on_stored callbacks
    after: list[Callable[[Spool], None]] = field(default_factory=list)
    eviction: Eviction | None = None
    synced: bool = False  # the commit was fsynced (a stored request needed it)


class Spool(SpoolHistory):
    """Thread-safe; every method is one short transaction under one lock.

    Acknowledging and the resend history (`ack`, `unack_since`, `purge_acked`, `held`,
    `holds`) are inherited from `SpoolHistory`.
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        max_messages: int,
        policy: Policy = "reject_new",
        ttl_s: float = 0.0,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self.policy = policy
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        # A corrupt file is moved aside and an empty spool opened (agent.delivery.spool_open).
        self._db, state, quarantine = open_checked(path, _read_state)
        self.quarantine: Quarantine | None = quarantine  # what was moved aside, and why
        self.count, self.bytes, self.history_bytes, last, self.request_keys = state
        self._ids = itertools.count(last + 1)
        self.evicted_messages = 0
        self.expired_messages = 0

    # -- messages ----------------------------------------------------------------------------

    def allocate_id(self) -> int:
        """The id of the next queued message: ids grow in the order messages are queued."""
        return next(self._ids)

    def write(
        self, items: Sequence[WriteItem], acks: Sequence[int], protected_after: int
    ) -> WriteResult:
        """Apply a batch in one transaction, in order; then mark `acks` acknowledged.

        Messages are inserted with the ids they were given; one the broker acknowledged
        before it was written (write-behind: the usual case while the broker keeps up) is
        inserted as acknowledged, so it costs one row write, not two. A message that
        `finishes` a stored request deletes it in the same transaction. Where a request is
        stored, the commit is fsynced (unless the request is settled within the batch: answered,
        every reply acknowledged). Over the caps, `drop_oldest` first evicts whole streams
        that are only on disk (ids above `protected_after`, not in this batch); `reject_new`
        is the queue's job (it waits for room before it queues), so a batch is always written.
        """
        result = WriteResult()
        acked_now = set(acks)
        rows: list[tuple[object, ...]] = []
        finished: list[str] = []
        deleted: list[str] = []  # finished requests stored by earlier batches
        pending = pending_bytes = 0  # of the messages written, those still unacknowledged
        # `streams`: those with a message the broker has not acknowledged yet.
        unsettled, streams = settlement(items, len(items), acked_now)
        durable = bool(unsettled)
        with self._lock:
            for item in items:
                if not isinstance(item, (StoreRequest, FinishRequest, AfterWrite)):
                    size = stored_bytes(item)
                    result.written += 1
                    result.written_bytes += size
                    if item.spool_id not in acked_now:
                        pending += 1
                        pending_bytes += size
            if pending and self._over(pending, pending_bytes):
                self._purge_acked_locked(float("inf"))  # history goes before anything pending
                if self.policy == "drop_oldest":
                    result.eviction = self._evict(pending, pending_bytes, protected_after, streams)
            now = time.time()
            # A request answered within this batch is neither inserted nor deleted. The commit
            # is fsynced before the requests stored in it are acknowledged to the broker,
            # except when each of them is answered in this batch and the broker already
            # acknowledged all their replies: then nothing of theirs needs the disk (a crash
            # before the commit loses only rows kept for resend), and a burst of fast requests
            # does not cost an fsync each (flash wear, CPU).
            stores: dict[str, StoreRequest] = {}
            if durable:
                self._db.execute("PRAGMA synchronous=FULL")
                result.synced = True
            try:
                self._db.execute("BEGIN")
                for item in items:
                    if isinstance(item, StoreRequest):
                        stores[item.key] = item
                        if item.on_stored is not None:
                            result.stored.append(item.on_stored)
                    elif isinstance(item, FinishRequest):
                        self._finish(item.key, stores, finished, deleted)
                    elif isinstance(item, AfterWrite):
                        result.after.append(item.callback)
                    else:
                        acked = now if item.spool_id in acked_now else None
                        rows.append(
                            (item.spool_id, item.stream, item.topic, item.payload, item.qos,
                             int(item.retain), item.correlation, now, acked, item.rid, item.seq)
                        )  # fmt: skip
                        if acked is not None:
                            acked_now.discard(item.spool_id)
                        if item.finishes is not None:
                            self._finish(item.finishes, stores, finished, deleted)
                self._execute_pieces(INSERT_SQL, INSERT_ROWS, rows)
                # Deletions before the inserts, as when each was deleted in turn.
                self._execute_pieces(
                    DELETE_REQUESTS_SQL, DELETE_REQUESTS, [(key,) for key in deleted]
                )
                self._execute_pieces(
                    INSERT_REQUESTS_SQL,
                    INSERT_REQUESTS,
                    [
                        (s.key, s.topic, s.payload, s.qos, s.response_topic, s.correlation, now)
                        for s in stores.values()
                    ],
                )
                earlier = [i for i in acks if i in acked_now]  # rows of previous batches
                marked = self._ack_locked(earlier, now) if earlier else (0, 0)
                self._db.execute("COMMIT")
            except BaseException as e:
                self._failed_write(e)
                raise
            finally:
                if durable:
                    self._db.execute("PRAGMA synchronous=NORMAL")
            self.count += pending - marked[0]
            self.bytes += pending_bytes - marked[1]
            self.history_bytes += result.written_bytes - pending_bytes + marked[1]
            self.request_keys.difference_update(finished)
        return result

    @staticmethod
    def _finish(
        key: str, stores: dict[str, StoreRequest], finished: list[str], deleted: list[str]
    ) -> None:
        """A request got its terminal message: forget it (in this batch, or on disk: `deleted`,
        whose rows the batch deletes; all of them come from earlier batches, since this
        batch's own stores are inserted after the deletions)."""
        if stores.pop(key, None) is None:
            deleted.append(key)
        finished.append(key)

    def _execute_pieces(
        self, sql: dict[int, str], largest: int, rows: Sequence[Sequence[object]]
    ) -> None:
        """`rows` with one multi-row statement per power-of-two piece (`spool_sql.pieces`),
        not `executemany`: a GIL release and retake per statement, not per row."""
        start = 0
        for size in pieces(len(rows), largest):
            self._db.execute(sql[size], [v for row in rows[start : start + size] for v in row])
            start += size

    def add(
        self,
        stream: str,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        correlation: bytes | None,
        *,
        finishes: str | None = None,
        protected_after: int = 0,
        rid: str | None = None,
        seq: int | None = None,
    ) -> tuple[int, Eviction | None]:
        """Store one message now (and forget request `finishes`, atomically). Returns its id.

        Over the caps, `reject_new` raises SpoolFull; `drop_oldest` evicts whole streams,
        oldest first, among the messages with id > `protected_after`, and reports what it
        evicted (SpoolFull when there is nothing to evict).
        """
        eviction = None
        row = _Row(self.allocate_id(), stream, topic, payload, qos, retain, correlation, finishes,
                   rid, seq)  # fmt: skip
        size = stored_bytes(row)
        with self._lock:
            if self._over(1, size):
                if self.policy == "reject_new":
                    raise SpoolFull(
                        f"spool full ({self.count} messages, {self.bytes} bytes; "
                        f"limits {self.max_messages}, {self.max_bytes})"
                    )
                eviction = self._evict(1, size, protected_after, {stream})
                if eviction is None:
                    raise SpoolFull("spool full and every message in it is already being published")
        self.write([row], (), protected_after)
        return row.spool_id, eviction

    def _over(self, messages: int, size: int) -> bool:
        return self.count + messages > self.max_messages or self.bytes + size > self.max_bytes

    def full(self, messages: int, size: int) -> bool:
        """Whether `messages` more pending messages of `size` bytes would pass a cap."""
        return self._over(messages, size)

    def _evict(
        self, messages: int, size: int, protected_after: int, keep: set[str]
    ) -> Eviction | None:
        """Drop whole streams waiting on disk, oldest first, until the batch fits."""
        streams: list[str] = []
        evicted = freed = 0
        while self._over(messages, size):
            marks = ",".join("?" * len(keep))
            row = self._db.execute(
                "SELECT stream FROM messages WHERE id > ? AND acked IS NULL"
                + (f" AND stream NOT IN ({marks})" if keep else "")
                + " ORDER BY id LIMIT 1",
                (protected_after, *keep),
            ).fetchone()
            if row is None:
                break
            victim = row[0]
            n, b = self._db.execute(
                f"SELECT COUNT(*), {SUM_STORED} FROM messages "
                "WHERE stream = ? AND id > ? AND acked IS NULL",
                (victim, protected_after),
            ).fetchone()
            self._db.execute(
                "DELETE FROM messages WHERE stream = ? AND id > ? AND acked IS NULL",
                (victim, protected_after),
            )
            self.count -= n
            self.bytes -= b
            evicted += n
            freed += b
            streams.append(victim)
            keep = keep | {victim}
        if not streams:
            if self._over(messages, size):
                log.warning(
                    "spool: over its caps and every pending message is already being published;"
                    " writing %d more",
                    messages,
                )
            return None
        self.evicted_messages += evicted
        return Eviction(tuple(streams), evicted, freed)

    def load_after(self, last_id: int, limit: int) -> list[SpooledMessage]:
        """Messages with id > `last_id`, oldest first: what the publisher sends next."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, stream, topic, payload, qos, retain, correlation FROM messages "
                "WHERE id > ? AND acked IS NULL ORDER BY id LIMIT ?",
                (last_id, limit),
            ).fetchall()
        return [SpooledMessage(r[0], r[1], r[2], bytes(r[3]), r[4], bool(r[5]), r[6]) for r in rows]

    def drop_stream(self, stream: str) -> int:
        """Forget the pending messages of a stream that is about to run again from the start."""
        with self._lock:
            n, b = self._db.execute(
                f"SELECT COUNT(*), {SUM_STORED} FROM messages WHERE stream = ? AND acked IS NULL",
                (stream,),
            ).fetchone()
            (acked,) = self._db.execute(
                f"SELECT {SUM_STORED} FROM messages WHERE stream = ? AND acked IS NOT NULL",
                (stream,),
            ).fetchone()
            self._db.execute("DELETE FROM messages WHERE stream = ?", (stream,))
            self.count -= n
            self.bytes -= b
            self.history_bytes -= acked
            return int(n)

    def expire(self, protected_after: int) -> int:
        """Drop messages older than `ttl_s` that are not yet handed to the publisher."""
        if self.ttl_s <= 0:
            return 0
        cutoff = time.time() - self.ttl_s
        with self._lock:
            n, b = self._db.execute(
                f"SELECT COUNT(*), {SUM_STORED} FROM messages "
                "WHERE created < ? AND id > ? AND acked IS NULL",
                (cutoff, protected_after),
            ).fetchone()
            if n:
                self._db.execute(
                    "DELETE FROM messages WHERE created < ? AND id > ? AND acked IS NULL",
                    (cutoff, protected_after),
                )
                self.count -= n
                self.bytes -= b
                self.expired_messages += n
            return int(n)

    # -- requests ----------------------------------------------------------------------------

    def store_request(
        self,
        key: str,
        topic: str,
        payload: bytes,
        qos: int,
        response_topic: str | None,
        correlation: bytes | None,
    ) -> bool:
        """Store a request now (fsynced); False when it is already stored (a redelivery)."""
        with self._lock:
            if key in self.request_keys:
                return False
            self.request_keys.add(key)
        self.write([StoreRequest(key, topic, payload, qos, response_topic, correlation)], (), 0)
        return True

    def finish_request(self, key: str) -> None:
        self.write([FinishRequest(key)], (), 0)

    def probe(self) -> None:
        """A small committed write that leaves nothing behind (a page's worth of request row,
        inserted and deleted): raises what the last failed write raised while the disk is
        still full (the spool writer tries it while nothing else is queued)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(
                    "INSERT OR REPLACE INTO requests VALUES"
                    " (?, '', zeroblob(4096), 0, NULL, NULL, 0)",
                    (PROBE_KEY,),
                )
                self._db.execute("DELETE FROM requests WHERE key = ?", (PROBE_KEY,))
                self._db.execute("COMMIT")
            except BaseException as e:
                self._failed_write(e)
                raise

    def _failed_write(self, error: BaseException) -> None:
        """After a write failed (under the lock): rolled back; a connection SQLite opened
        read-only (the disk was, then), which stays so for its life, opened again for the
        next try (a failure to reopen leaves it to the try after)."""
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
        if not (isinstance(error, sqlite3.OperationalError) and "readonly" in str(error)):
            return
        try:
            fresh = connect(self.path)
        except (sqlite3.Error, OSError):
            return
        with contextlib.suppress(sqlite3.Error):
            self._db.close()
        self._db = fresh
        with contextlib.suppress(sqlite3.Error):
            prepare(fresh)

    def unfinished_requests(self) -> list[StoredRequest]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, topic, payload, qos, response_topic, correlation FROM requests "
                "ORDER BY received"
            ).fetchall()
        return [StoredRequest(r[0], r[1], bytes(r[2]), r[3], r[4], r[5]) for r in rows]

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                log.exception("spool: close failed")


_State = tuple[int, int, int, int, set[str]]


def _read_state(db: sqlite3.Connection) -> _State:
    """What the spool keeps in memory, read from the file: the pending messages' count and
    bytes, the acknowledged history's bytes, the last id ever used, the stored requests'
    keys (a redelivery of one of them is a duplicate; only the ingress adds, only the writer
    removes, after the deletion is committed)."""
    row = db.execute(f"SELECT COUNT(*), {SUM_STORED} FROM messages WHERE acked IS NULL")
    count, size = (int(v) for v in row.fetchone())
    (history,) = db.execute(f"SELECT {SUM_STORED} FROM messages WHERE acked IS NOT NULL").fetchone()
    (last,) = db.execute(
        "SELECT MAX(COALESCE((SELECT MAX(id) FROM messages), 0),"
        " COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'messages'), 0))"
    ).fetchone()
    keys = {str(key) for (key,) in db.execute("SELECT key FROM requests")}
    return count, size, int(history), int(last), keys


@dataclass(frozen=True)
class _Row:
    """A message stored directly (`Spool.add`), without a queue."""

    spool_id: int
    stream: str
    topic: str
    payload: bytes
    qos: int
    retain: bool
    correlation: bytes | None
    finishes: str | None
    rid: str | None
    seq: int | None
