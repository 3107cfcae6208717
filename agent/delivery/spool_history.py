"""The spool's history: messages the broker acknowledged, kept for a while so they can be
published again. Two readers need them: a reconnect (a broker acknowledges before it saves,
so after a broker crash the most recent ones are made pending again, `unack_since`), and
application-level resend (`held`, `holds`: agent.delivery.resend). The window is bounded by
age and bytes (`purge_acked`).

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
            f"SELECT {SUM_STORED} FROM messages WHERE acked IS NOT NULL AND acked < ?",
            (cutoff,),
        ).fetchone()
        cursor = self._db.execute(
            "DELETE FROM messages WHERE acked IS NOT NULL AND acked < ?", (cutoff,)
        )
        self.history_bytes -= freed
        return cursor.rowcount
