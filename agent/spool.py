"""The on-disk spool: QoS 1/2 messages until the broker acknowledged them, and requests until
they got their terminal message. SQLite in WAL mode, one file under `state_dir`.

Why SQLite: it is in the standard library, crash-safe (a SIGKILL or power cut leaves the last
committed state, never a torn file), and an ordered table with a primary key is exactly a
durable FIFO. Two connections share the file:

* `requests` commit with `synchronous=FULL` (an fsync): a request is acknowledged to the broker
  only after it is stored, so it must survive a power cut.
* `messages` commit with `synchronous=NORMAL` (no fsync per chunk): they survive a crash of
  the process; after a power cut the lost tail is regenerated, because the request whose
  terminal message was lost is still stored and runs again. WAL order makes that safe: a
  later transaction is never on disk without the earlier ones.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Policy = Literal["reject_new", "drop_oldest"]

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


class Spool:
    """Thread-safe; every method is one short transaction."""

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
        self._db = self._open(path, "NORMAL")
        self._requests_db = self._open(path, "FULL")
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM messages WHERE acked IS NULL"
        )
        self.count, self.bytes = (int(v) for v in row.fetchone())  # pending messages only
        (history,) = self._db.execute(
            "SELECT COALESCE(SUM(LENGTH(payload)), 0) FROM messages WHERE acked IS NOT NULL"
        ).fetchone()
        self.history_bytes = int(history)  # acknowledged, kept for resend
        self.evicted_messages = 0
        self.expired_messages = 0

    @staticmethod
    def _open(path: Path, synchronous: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.executescript(SCHEMA)
        return db

    # -- messages ----------------------------------------------------------------------------

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
        """Store a message (and forget request `finishes`, atomically). Returns its id.

        Over the caps, `reject_new` raises SpoolFull; `drop_oldest` evicts whole streams,
        oldest first, among the messages with id > `protected_after` (those not yet handed to
        the publisher), and reports what it evicted.
        """
        with self._lock:
            if self._full(len(payload)):
                self._purge_acked_locked(float("inf"))  # history goes before anything pending
            eviction = self._make_room(len(payload), protected_after, stream)
            self._db.execute("BEGIN")
            try:
                cursor = self._db.execute(
                    "INSERT INTO messages (stream, topic, payload, qos, retain, correlation,"
                    " created, rid, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (stream, topic, payload, qos, int(retain), correlation, time.time(), rid, seq),
                )
                if finishes is not None:
                    self._db.execute("DELETE FROM requests WHERE key = ?", (finishes,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self.count += 1
            self.bytes += len(payload)
            assert cursor.lastrowid is not None
            return cursor.lastrowid, eviction

    def _full(self, extra: int) -> bool:
        return self.count + 1 > self.max_messages or self.bytes + extra > self.max_bytes

    def _make_room(self, size: int, protected_after: int, stream: str) -> Eviction | None:
        if not self._full(size):
            return None
        if self.policy == "reject_new":
            raise SpoolFull(
                f"spool full ({self.count} messages, {self.bytes} bytes; "
                f"limits {self.max_messages}, {self.max_bytes})"
            )
        streams: list[str] = []
        messages = freed = 0
        while self._full(size):
            row = self._db.execute(
                "SELECT stream FROM messages WHERE id > ? AND stream != ? AND acked IS NULL "
                "ORDER BY id LIMIT 1",
                (protected_after, stream),
            ).fetchone()
            if row is None:
                if streams:
                    break
                raise SpoolFull("spool full and every message in it is already being published")
            victim = row[0]
            n, b = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM messages "
                "WHERE stream = ? AND id > ? AND acked IS NULL",
                (victim, protected_after),
            ).fetchone()
            self._db.execute(
                "DELETE FROM messages WHERE stream = ? AND id > ? AND acked IS NULL",
                (victim, protected_after),
            )
            self.count -= n
            self.bytes -= b
            messages += n
            freed += b
            streams.append(victim)
        self.evicted_messages += messages
        return Eviction(tuple(streams), messages, freed)

    def ack(self, ids: Sequence[int]) -> None:
        """The broker acknowledged these: no longer pending.

        They are kept as history for a while (see `purge_acked`): a broker acknowledges
        before it saves, so after a broker crash the most recent ones are published again.
        """
        if not ids:
            return
        now = time.time()
        with self._lock:
            n, b = 0, 0
            self._db.execute("BEGIN")
            for start in range(0, len(ids), 500):
                chunk = list(ids[start : start + 500])
                marks = ",".join("?" * len(chunk))
                where = f"id IN ({marks}) AND acked IS NULL"
                row = self._db.execute(
                    f"SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM messages "
                    f"WHERE {where}",
                    chunk,
                ).fetchone()
                self._db.execute(f"UPDATE messages SET acked = ? WHERE {where}", [now, *chunk])
                n += row[0]
                b += row[1]
            self._db.execute("COMMIT")
            self.count -= n
            self.bytes -= b
            self.history_bytes += b

    def unack_since(self, since: float) -> int | None:
        """Make messages acknowledged at or after `since` pending again; their smallest id."""
        with self._lock:
            n, b, first = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0), MIN(id) FROM messages "
                "WHERE acked >= ?",
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
                        "SELECT id, LENGTH(payload) FROM messages WHERE acked IS NOT NULL "
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
        """The stored messages of stream `rid` (acknowledged or not) to publish again."""
        query = (
            "SELECT id, stream, topic, payload, qos, retain, correlation FROM messages "
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
            if r[0] in seen:
                continue
            seen.add(r[0])
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
            "SELECT COALESCE(SUM(LENGTH(payload)), 0) FROM messages "
            "WHERE acked IS NOT NULL AND acked < ?",
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
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM messages "
                "WHERE stream = ? AND acked IS NULL",
                (stream,),
            ).fetchone()
            (acked,) = self._db.execute(
                "SELECT COALESCE(SUM(LENGTH(payload)), 0) FROM messages "
                "WHERE stream = ? AND acked IS NOT NULL",
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
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM messages "
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
        """Store before acknowledging; False when the same request is already stored (a
        redelivery of a message whose acknowledgement was lost)."""
        with self._lock:
            try:
                self._requests_db.execute(
                    "INSERT INTO requests (key, topic, payload, qos, response_topic, correlation,"
                    " received) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (key, topic, payload, qos, response_topic, correlation, time.time()),
                )
            except sqlite3.IntegrityError:
                return False
            return True

    def finish_request(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM requests WHERE key = ?", (key,))

    def unfinished_requests(self) -> list[StoredRequest]:
        with self._lock:
            rows = self._db.execute(
                "SELECT key, topic, payload, qos, response_topic, correlation FROM requests "
                "ORDER BY received"
            ).fetchall()
        return [StoredRequest(r[0], r[1], bytes(r[2]), r[3], r[4], r[5]) for r in rows]

    def close(self) -> None:
        with self._lock:
            for db in (self._requests_db, self._db):
                try:
                    db.close()
                except sqlite3.Error:
                    log.exception("spool: close failed")


def request_key(model: str, request_id: str) -> str:
    return f"{model}/{request_id}"
