"""The spool's history: messages the broker acknowledged, kept for a while so they can be
published again. Two readers need them: a reconnect (a broker acknowledges before it saves,
so after a broker crash the most recent ones are made pending again, `unack_since`), and
application-level resend (`held_index`, `load`, `holds`: agent.delivery.resend). The window
is bounded by age and bytes (`purge_acked`). `forget` deletes quarantined messages.

`SpoolHistory` is a part of `Spool` (agent.delivery.spool), which owns the connection, the
lock and the counters these methods keep up to date.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence

from agent.delivery.spool_items import SpooledMessage
from agent.delivery.spool_sql import STORED_BYTES_SQL, SUM_STORED
from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload


class SpoolHistory:
    """Acknowledging messages, and the acknowledged ones kept for resend; a base of `Spool`.

    Every method takes the spool's lock; the `_locked` ones run under it already.
    """

    # Set by `Spool.__init__`.
    _db: sqlite3.Connection
    _lock: threading.Lock
    count: int  # pending messages
    bytes: int  # their stored bytes
    history_bytes: int  # the stored bytes of acknowledged ones

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
                f"SELECT COUNT(*), {SUM_STORED} FROM messages WHERE {where}",
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
                f"SELECT COUNT(*), {SUM_STORED}, MIN(id) FROM messages WHERE acked >= ?",
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
        return self.load([row_id for row_id, _ in self.held_index(rid, seqs, from_seq)])

    def held_index(
        self, rid: str, seqs: Sequence[int] | None, from_seq: int | None
    ) -> list[tuple[int, int]]:
        """`held` without the payloads: `(id, payload bytes)` of each message, in seq order,
        so a resend loads only what its rate limits let it publish (`load`)."""
        query = "SELECT id, seq, LENGTH(payload) FROM messages WHERE rid = ?"
        if seqs is not None:
            rows = []
            for start in range(0, len(seqs), 990):  # within 999 host parameters a statement
                chunk = list(seqs[start : start + 990])
                with self._lock:
                    rows += self._db.execute(
                        query + f" AND seq IN ({','.join('?' * len(chunk))})", [rid, *chunk]
                    ).fetchall()
            rows.sort(key=lambda r: (r[1], r[0]))
        else:
            args: list[object] = [rid]
            if from_seq is not None:
                query += " AND seq >= ?"
                args.append(from_seq)
            with self._lock:
                rows = self._db.execute(query + " ORDER BY seq, id", args).fetchall()
        seen: set[int] = set()
        out = []
        for row_id, seq, size in rows:
            if seq is not None:
                if seq in seen:
                    continue  # the first run's copy of this seq was taken (ordered by seq, id)
                seen.add(seq)
            out.append((row_id, size))
        return out

    def load(self, ids: Sequence[int]) -> list[SpooledMessage]:
        """The messages with these ids, in the order given (those still stored)."""
        found: dict[int, SpooledMessage] = {}
        for start in range(0, len(ids), 990):
            chunk = list(ids[start : start + 990])
            with self._lock:
                rows = self._db.execute(
                    "SELECT id, stream, topic, payload, qos, retain, correlation FROM messages "
                    f"WHERE id IN ({','.join('?' * len(chunk))})",
                    chunk,
                ).fetchall()
            for r in rows:
                found[r[0]] = SpooledMessage(r[0], r[1], r[2], bytes(r[3]), r[4], bool(r[5]), r[6])
        return [found[i] for i in ids if i in found]

    def forget(self, ids: Sequence[int]) -> int:
        """Delete these messages, pending or acknowledged (quarantined: never published
        again, nor resent); returns how many were stored."""
        forgotten = 0
        with self._lock:
            for start in range(0, len(ids), 990):
                chunk = list(ids[start : start + 990])
                where = f"id IN ({','.join('?' * len(chunk))})"
                for pending, size in self._db.execute(
                    f"SELECT acked IS NULL, {STORED_BYTES_SQL} FROM messages WHERE {where}", chunk
                ).fetchall():
                    if pending:
                        self.count -= 1
                        self.bytes -= size
                    else:
                        self.history_bytes -= size
                    forgotten += 1
                self._db.execute(f"DELETE FROM messages WHERE {where}", chunk)
        return forgotten

    def stream_version(self, stream: str) -> int | None:
        """The model version `stream`'s first held message names (its envelope's `version`),
        or None: none held (a stream not begun, or of QoS 0 replies), none naming one. A
        stored request runs again on it after a crash, so that a hot swap meanwhile cannot
        make one stream of two versions."""
        with self._lock:
            row = self._db.execute(
                "SELECT payload FROM messages WHERE stream = ? ORDER BY seq LIMIT 1", (stream,)
            ).fetchone()
        if row is None:
            return None
        payload = bytes(row[0])
        try:  # the agent's own message: limits as large as it is
            message = decode_payload(payload, Limits(max_payload_bytes=len(payload) + 1))
        except WireError:
            return None
        version = message.get("version")
        return version if isinstance(version, int) and not isinstance(version, bool) else None

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
            f"SELECT {SUM_STORED} FROM messages WHERE acked IS NOT NULL AND acked < ?",
            (cutoff,),
        ).fetchone()
        cursor = self._db.execute(
            "DELETE FROM messages WHERE acked IS NOT NULL AND acked < ?", (cutoff,)
        )
        self.history_bytes -= freed
        return cursor.rowcount
