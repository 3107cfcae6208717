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
"""

from __future__ import annotations

import itertools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

log = logging.getLogger(__name__)

Policy = Literal["reject_new", "drop_oldest"]

WAL_SIZE_LIMIT = 8 * 1024 * 1024  # bytes the WAL keeps after a checkpoint (auto one at ~4 MB)

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    stream TEXT NOT NULL,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    correlation BLOB,
    created REAL NOT NULL,
    acked REAL,
    rid TEXT,
    seq INTEGER
);
CREATE INDEX IF NOT EXISTS messages_rid ON messages (rid, seq);
CREATE INDEX IF NOT EXISTS messages_stream ON messages (stream, id);
CREATE INDEX IF NOT EXISTS messages_acked ON messages (acked);
CREATE TABLE IF NOT EXISTS requests (
    key TEXT PRIMARY KEY,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    response_topic TEXT,
    correlation BLOB,
    received REAL NOT NULL
);
"""


# Rows go in with multi-row statements: the sqlite3 module releases and retakes the GIL around
# every statement step, and under load each retake waits for the inference and network
# threads. A batch of n rows is cut into power-of-two pieces (`_pieces`), so the connection
# prepares and keeps a few statements per kind (one per size), not one per row count, which
# took about 9 MB more (batches of 1-90 messages and 1-64 requests: 30.7 MB resident, 21.5 now).
_PIECE_SIZES = tuple(1 << k for k in range(10))  # 1 .. 512


def _pieces(n: int, largest: int) -> list[int]:
    """Sizes adding up to `n`: `largest` (a power of two) while it fits, then the powers of
    two of the rest, largest first."""
    sizes = [largest] * (n // largest)
    rest = n % largest
    sizes.extend(size for size in reversed(_PIECE_SIZES) if rest & size)
    return sizes


def _multi_row_sql(head: str, columns: int, largest: int) -> dict[int, str]:
    """`HEAD VALUES (?, ...), ...` for each power-of-two row count up to `largest`."""
    row = "(" + ", ".join("?" * columns) + ")"
    return {n: f"{head} VALUES " + ", ".join([row] * n) for n in _PIECE_SIZES if n <= largest}


# Messages: 11 parameters a row, within SQLite's oldest default limit of 999 host parameters.
INSERT_ROWS = 64
_INSERT_SQL = _multi_row_sql(
    "INSERT INTO messages (id, stream, topic, payload, qos, retain, correlation, created,"
    " acked, rid, seq)",
    11,
    INSERT_ROWS,
)
# Stored requests (7 parameters a row) and the deletion of finished ones (one a key).
INSERT_REQUESTS = 128
_INSERT_REQUESTS_SQL = _multi_row_sql(
    "INSERT OR IGNORE INTO requests (key, topic, payload, qos, response_topic, correlation,"
    " received)",
    7,
    INSERT_REQUESTS,
)
DELETE_REQUESTS = 512
_DELETE_REQUESTS_SQL = {
    n: "DELETE FROM requests WHERE key IN (" + ",".join("?" * n) + ")" for n in _PIECE_SIZES
}

# What a message row costs on disk besides the strings it holds: the id, the timestamps and
# small columns, the entries of the three indexes (which repeat the stream key and request
# id, counted twice below), and the b-tree's own headers and free space. Measured with small
# chunks (tests/test_spool.py checks the estimate against the file). The caps count this
# estimate, so `max_bytes` bounds the file rather than the payloads alone: a 134-byte chunk
# takes about 400 bytes of disk.
ROW_OVERHEAD_BYTES = 120
STORED_BYTES_SQL = (
    "(LENGTH(payload) + LENGTH(topic) + 2 * LENGTH(stream) + 2 * COALESCE(LENGTH(rid), 0)"
    " + COALESCE(LENGTH(correlation), 0)"
    f" + {ROW_OVERHEAD_BYTES})"
)
_SUM_STORED = f"COALESCE(SUM({STORED_BYTES_SQL}), 0)"


def stored_bytes(row: MessageRow) -> int:
    """The disk a message's row takes, as the caps count it (STORED_BYTES_SQL in Python; text
    is counted in characters, as SQLite's LENGTH does, so both always agree)."""
    size = len(row.payload) + len(row.topic) + ROW_OVERHEAD_BYTES
    if row.stream is not None:
        size += 2 * len(row.stream)
    if row.rid is not None:
        size += 2 * len(row.rid)
    if row.correlation is not None:
        size += len(row.correlation)
    return size


class SpoolFull(Exception):
    """No room for the message under the `reject_new` policy (or nothing left to evict)."""


@dataclass(frozen=True)
class SpooledMessage:
    id: int
    stream: str
    topic: str
    payload: bytes
    qos: int
    retain: bool
    correlation: bytes | None


@dataclass(frozen=True)
class StoredRequest:
    key: str
    topic: str
    payload: bytes
    qos: int
    response_topic: str | None
    correlation: bytes | None


@dataclass(frozen=True)
class Eviction:
    streams: tuple[str, ...]
    messages: int
    bytes: int


class MessageRow(Protocol):
    """A queued message as the spool stores it (`agent.delivery.outbox.OutMessage` is one)."""

    @property
    def spool_id(self) -> int | None: ...
    @property
    def stream(self) -> str | None: ...
    @property
    def topic(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def qos(self) -> int: ...
    @property
    def retain(self) -> bool: ...
    @property
    def correlation(self) -> bytes | None: ...
    @property
    def finishes(self) -> str | None: ...
    @property
    def rid(self) -> str | None: ...
    @property
    def seq(self) -> int | None: ...


@dataclass(frozen=True)
class StoreRequest(StoredRequest):
    """Store a received request; `on_stored` runs once it is on disk (fsynced)."""

    on_stored: Callable[[], None] | None = None
    queued_at: float = field(default_factory=time.monotonic, compare=False)


@dataclass(frozen=True)
class FinishRequest:
    """Forget a stored request (its terminal message went out without touching the disk)."""

    key: str


@dataclass(frozen=True)
class AfterWrite:
    """Run `callback(spool)` on the writer thread once everything queued before is written."""

    callback: Callable[[Spool], None]


WriteItem = MessageRow | StoreRequest | FinishRequest | AfterWrite


def settled_prefix(
    items: Sequence[WriteItem], acks: Sequence[int], now: float, grace_s: float
) -> int:
    """How many of `items` (in order) to write now. All of them, unless a request stored among
    them is not settled yet (unanswered, or a reply the broker has not acknowledged) and was
    queued less than `grace_s` ago: then the batch ends before it, where every request stored
    in the batch is settled, so its commit needs no fsync, and the rest waits for the next
    batch (by then a fast request is answered and needs no fsync either). A request that is
    older and still unsettled needs the disk anyway: everything is written, and fsynced."""
    acked = set(acks)
    cut = len(items)
    while True:
        unsettled, _ = _settlement(items, cut, acked)
        if not unsettled:
            return cut
        position, queued_at = min(unsettled)
        if now - queued_at >= grace_s:
            return len(items)
        cut = position  # its stores' answers may lie past the new end: look again


def _settlement(
    items: Sequence[WriteItem], end: int, acked: set[int]
) -> tuple[list[tuple[int, float]], set[str]]:
    """The rule a commit is fsynced by. For `items[:end]`: the (position, queue time) of each
    request stored there and not settled within them (unanswered, or a message of its stream
    the broker has not acknowledged), and the streams with such a message."""
    answered: dict[str, bool] = {}
    stored: dict[str, tuple[int, float]] = {}
    streams: set[str] = set()
    for position in range(end):
        item = items[position]
        if isinstance(item, StoreRequest):
            answered[item.key] = False
            stored[item.key] = (position, item.queued_at)
        elif isinstance(item, FinishRequest):
            if item.key in answered:
                answered[item.key] = True
        elif not isinstance(item, AfterWrite):
            if item.spool_id not in acked and item.stream is not None:
                streams.add(item.stream)
            if item.finishes is not None and item.finishes in answered:
                answered[item.finishes] = True
    unsettled = [stored[key] for key, done in answered.items() if not done or key in streams]
    return unsettled, streams


@dataclass
class WriteResult:
    written: int = 0  # messages
    written_bytes: int = 0
    stored: list[Callable[[], None]] = field(default_factory=list)  # on_stored callbacks
    after: list[Callable[[Spool], None]] = field(default_factory=list)
    eviction: Eviction | None = None
    synced: bool = False  # the commit was fsynced (a stored request needed it)


class Spool:
    """Thread-safe; every method is one short transaction under one lock."""

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
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # Statement journals and sort files in memory: SQLite would otherwise create, unlink
        # and write a file in /var/tmp for a large multi-row statement (several per second
        # under load: file system writes on the flash the spool is meant to spare).
        self._db.execute("PRAGMA temp_store=MEMORY")
        # SQLite reuses the WAL after a checkpoint but never shrinks it: one large transaction
        # (a drain's backlog, a burst of big replies) would keep its size on the flash until
        # the agent stops. The limit truncates it at the next reuse.
        self._db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        self._db.executescript(SCHEMA)
        row = self._db.execute(f"SELECT COUNT(*), {_SUM_STORED} FROM messages WHERE acked IS NULL")
        self.count, self.bytes = (int(v) for v in row.fetchone())  # pending messages only
        (history,) = self._db.execute(
            f"SELECT {_SUM_STORED} FROM messages WHERE acked IS NOT NULL"
        ).fetchone()
        self.history_bytes = int(history)  # acknowledged, kept for resend
        (last,) = self._db.execute(
            "SELECT MAX(COALESCE((SELECT MAX(id) FROM messages), 0),"
            " COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'messages'), 0))"
        ).fetchone()
        self._ids = itertools.count(int(last) + 1)
        # Stored requests without their terminal message, and those being stored now: a
        # redelivery of one of them is a duplicate. Only the ingress adds, only the writer
        # (after the deletion is committed) removes.
        self.request_keys: set[str] = {
            key for (key,) in self._db.execute("SELECT key FROM requests")
        }
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
        unsettled, streams = _settlement(items, len(items), acked_now)
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
                self._execute_pieces(_INSERT_SQL, INSERT_ROWS, rows)
                # Deletions before the inserts, as when each was deleted in turn.
                self._execute_pieces(
                    _DELETE_REQUESTS_SQL, DELETE_REQUESTS, [(key,) for key in deleted]
                )
                self._execute_pieces(
                    _INSERT_REQUESTS_SQL,
                    INSERT_REQUESTS,
                    [
                        (s.key, s.topic, s.payload, s.qos, s.response_topic, s.correlation, now)
                        for s in stores.values()
                    ],
                )
                earlier = [i for i in acks if i in acked_now]  # rows of previous batches
                marked = self._ack_locked(earlier, now) if earlier else (0, 0)
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
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
        """`rows` with one multi-row statement per power-of-two piece (see `_pieces`), not
        `executemany`: a GIL release and retake per statement, not per row."""
        start = 0
        for size in _pieces(len(rows), largest):
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
                f"SELECT COUNT(*), {_SUM_STORED} FROM messages "
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

    def ack(self, ids: Sequence[int]) -> None:
        """The broker acknowledged these: no longer pending.

        They are kept as history for a while (see `purge_acked`): a broker acknowledges
        before it saves, so after a broker crash the most recent ones are published again.
        """
        if not ids:
            return
        with self._lock:
            self._db.execute("BEGIN")
            try:
                n, b = self._ack_locked(ids, time.time())
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self.count -= n
            self.bytes -= b
            self.history_bytes += b

    def _ack_locked(self, ids: Sequence[int], now: float) -> tuple[int, int]:
        n = b = 0
        for start in range(0, len(ids), 990):  # within 999 host parameters a statement
            chunk = list(ids[start : start + 990])
            marks = ",".join("?" * len(chunk))
            where = f"id IN ({marks}) AND acked IS NULL"
            row = self._db.execute(
                f"SELECT COUNT(*), {_SUM_STORED} FROM messages WHERE {where}",
                chunk,
            ).fetchone()
            self._db.execute(f"UPDATE messages SET acked = ? WHERE {where}", [now, *chunk])
            n += row[0]
            b += row[1]
        return n, b

    def unack_since(self, since: float) -> int | None:
        """Make messages acknowledged at or after `since` pending again; their smallest id."""
        with self._lock:
            n, b, first = self._db.execute(
                f"SELECT COUNT(*), {_SUM_STORED}, MIN(id) FROM messages WHERE acked >= ?",
                (since,),
            ).fetchone()
            if not n:
                return None
            self._db.execute("UPDATE messages SET acked = NULL WHERE acked >= ?", (since,))
            self.count += n
            self.bytes += b
            self.history_bytes -= b
            return int(first)

    def purge_acked(self, older_than_s: float, max_bytes: int | None = None) -> int:
        """Forget acknowledged messages older than `older_than_s` seconds, and the oldest
        ones beyond `max_bytes` of history (the resend window is bounded by age and bytes)."""
        with self._lock:
            purged = self._purge_acked_locked(time.time() - older_than_s)
            if max_bytes is not None:
                history = self.history_bytes
                while history > max_bytes:
                    rows = self._db.execute(
                        f"SELECT id, {STORED_BYTES_SQL} FROM messages WHERE acked IS NOT NULL "
                        "ORDER BY id LIMIT 1000"
                    ).fetchall()
                    if not rows:
                        break
                    drop, freed = [], 0
                    for row_id, size in rows:
                        drop.append(row_id)
                        freed += size
                        if history - freed <= max_bytes:
                            break
                    marks = ",".join("?" * len(drop))
                    self._db.execute(f"DELETE FROM messages WHERE id IN ({marks})", drop)
                    history -= freed
                    purged += len(drop)
                self.history_bytes = history
            return purged

    def held(
        self, rid: str, seqs: Sequence[int] | None, from_seq: int | None
    ) -> list[SpooledMessage]:
        """The stored messages of stream `rid` (acknowledged or not) to publish again, one per
        seq: a request that ran twice (a redelivery after it finished) holds each seq twice,
        and its subscriber needs it once."""
        query = (
            "SELECT id, stream, topic, payload, qos, retain, correlation, seq FROM messages "
            "WHERE rid = ?"
        )
        args: list[object] = [rid]
        if seqs is not None:
            query += f" AND seq IN ({','.join('?' * len(seqs))})"
            args += list(seqs)
        elif from_seq is not None:
            query += " AND seq >= ?"
            args.append(from_seq)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq, id", args).fetchall()
        seen: set[int] = set()
        out = []
        for r in rows:
            if r[7] is not None:
                if r[7] in seen:
                    continue  # the first run's copy of this seq was taken (ordered by seq, id)
                seen.add(r[7])
            out.append(SpooledMessage(r[0], r[1], r[2], bytes(r[3]), r[4], bool(r[5]), r[6]))
        return out

    def holds(self, rid: str) -> bool:
        """A stream with messages held, or a stored request that has not finished yet."""
        with self._lock:
            row = self._db.execute("SELECT 1 FROM messages WHERE rid = ? LIMIT 1", (rid,))
            if row.fetchone() is not None:
                return True
            row = self._db.execute(
                "SELECT 1 FROM requests WHERE substr(key, instr(key, '/') + 1) = ? LIMIT 1",
                (rid,),
            )
            return row.fetchone() is not None

    def _purge_acked_locked(self, cutoff: float) -> int:
        # A range on the `acked` index: only the rows being forgotten are read.
        (freed,) = self._db.execute(
            f"SELECT {_SUM_STORED} FROM messages WHERE acked IS NOT NULL AND acked < ?",
            (cutoff,),
        ).fetchone()
        cursor = self._db.execute(
            "DELETE FROM messages WHERE acked IS NOT NULL AND acked < ?", (cutoff,)
        )
        self.history_bytes -= freed
        return cursor.rowcount

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
                f"SELECT COUNT(*), {_SUM_STORED} FROM messages WHERE stream = ? AND acked IS NULL",
                (stream,),
            ).fetchone()
            (acked,) = self._db.execute(
                f"SELECT {_SUM_STORED} FROM messages WHERE stream = ? AND acked IS NOT NULL",
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
                f"SELECT COUNT(*), {_SUM_STORED} FROM messages "
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


def request_key(model: str, request_id: str) -> str:
    return f"{model}/{request_id}"


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
