"""The spool file's SQL: how the file is opened, its schema, the multi-row statements a batch
is written with, and what a row counts against the caps (in SQL and in Python, which agree).

The `Spool` (agent.delivery.spool) runs these; nothing here holds state.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.delivery.spool_items import MessageRow

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


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the spool file at `path` (its folder made if missing), in autocommit
    mode (the spool opens its transactions itself), usable from any thread. SQLite reads
    nothing yet: `prepare` is the first statement."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)


def prepare(db: sqlite3.Connection) -> None:
    """The connection in WAL mode with the spool's settings, the tables made if missing."""
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    # Statement journals and sort files in memory: SQLite would otherwise create, unlink
    # and write a file in /var/tmp for a large multi-row statement (several per second
    # under load: file system writes on the flash the spool is meant to spare).
    db.execute("PRAGMA temp_store=MEMORY")
    # SQLite reuses the WAL after a checkpoint but never shrinks it: one large transaction
    # (a drain's backlog, a burst of big replies) would keep its size on the flash until
    # the agent stops. The limit truncates it at the next reuse.
    db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    db.executescript(SCHEMA)


# Rows go in with multi-row statements: the sqlite3 module releases and retakes the GIL around
# every statement step, and under load each retake waits for the inference and network
# threads. A batch of n rows is cut into power-of-two pieces (`pieces`), so the connection
# prepares and keeps a few statements per kind (one per size), not one per row count, which
# took about 9 MB more (batches of 1-90 messages and 1-64 requests: 30.7 MB resident, 21.5 now).
PIECE_SIZES = tuple(1 << k for k in range(10))  # 1 .. 512


def pieces(n: int, largest: int) -> list[int]:
    """Sizes adding up to `n`: `largest` (a power of two) while it fits, then the powers of
    two of the rest, largest first."""
    sizes = [largest] * (n // largest)
    rest = n % largest
    sizes.extend(size for size in reversed(PIECE_SIZES) if rest & size)
    return sizes


def multi_row_sql(head: str, columns: int, largest: int) -> dict[int, str]:
    """`HEAD VALUES (?, ...), ...` for each power-of-two row count up to `largest`."""
    row = "(" + ", ".join("?" * columns) + ")"
    return {n: f"{head} VALUES " + ", ".join([row] * n) for n in PIECE_SIZES if n <= largest}


# Messages: 11 parameters a row, within SQLite's oldest default limit of 999 host parameters.
INSERT_ROWS = 64
INSERT_SQL = multi_row_sql(
    "INSERT INTO messages (id, stream, topic, payload, qos, retain, correlation, created,"
    " acked, rid, seq)",
    11,
    INSERT_ROWS,
)
# Stored requests (7 parameters a row) and the deletion of finished ones (one a key).
INSERT_REQUESTS = 128
INSERT_REQUESTS_SQL = multi_row_sql(
    "INSERT OR IGNORE INTO requests (key, topic, payload, qos, response_topic, correlation,"
    " received)",
    7,
    INSERT_REQUESTS,
)
DELETE_REQUESTS = 512
DELETE_REQUESTS_SQL = {
    n: "DELETE FROM requests WHERE key IN (" + ",".join("?" * n) + ")" for n in PIECE_SIZES
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
SUM_STORED = f"COALESCE(SUM({STORED_BYTES_SQL}), 0)"


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
