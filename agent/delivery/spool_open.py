"""Opening the spool file so that a corrupt one never stops the agent from starting.

A flash that lost a page, a file truncated by a full disk on another system, or anything
else that is not a SQLite database would otherwise make every start raise
`sqlite3.DatabaseError` and put the service into a restart loop. Here the file is checked
when it is opened (the open itself, then `PRAGMA quick_check`, which reads every page: about
65 ms for a 100 MB spool with a warm page cache, 1.5 s cold on the development VM, see
docs/decisions/0020-state-files-never-stop-startup.md). A corrupt file is moved aside with its
`-wal` and `-shm` as `NAME.corrupt-<UTC time>` (kept for the operator, never deleted) and the
agent starts with an empty spool; the `Quarantine` says what happened, for the WARNING, the
counter and the `spool_quarantined` event.

Errors that are not corruption (a locked file, no permission, a full disk) are raised,
naming the file: moving a healthy spool aside would lose what it holds.

A `-wal` whose header SQLite does not recognise (a lost flash page) would be taken as empty
without a word, losing the transactions it held (stored requests among them): it is moved
aside with its `-shm` (the same WARNING, counter and event), and the database file, whose
checkpointed transactions are sound, is kept.
"""

from __future__ import annotations

import datetime
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from agent.config.state_files import FILE_MODE, fsync_dir, private_dir, private_file, tighten
from agent.delivery.spool_sql import connect, prepare

log = logging.getLogger(__name__)

T = TypeVar("T")

SQLITE_CORRUPT = 11
SQLITE_NOTADB = 26
CORRUPTION_WORDS = ("malformed", "not a database", "corrupt")
COMPANIONS = ("-wal", "-shm")  # SQLite's own files next to the database
WAL_MAGIC = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")  # a WAL header's first bytes
WAL_HEADER_BYTES = 32
DISK_WORDS = ("I/O", "unable to open", "full", "readonly")


@dataclass(frozen=True)
class Quarantine:
    """A corrupt spool moved aside: where it is now and why."""

    path: Path  # the database file as moved
    reason: str


class SpoolCorrupt(Exception):
    """The spool file is not a sound SQLite database."""


def is_corruption(error: BaseException) -> bool:
    """Whether a SQLite error says the file is damaged (not locked, not full, not denied)."""
    if isinstance(error, SpoolCorrupt):
        return True
    if not isinstance(error, sqlite3.DatabaseError):
        return False
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return (code & 0xFF) in (SQLITE_CORRUPT, SQLITE_NOTADB)
    text = str(error).lower()
    return any(word in text for word in CORRUPTION_WORDS)


def open_checked(
    path: Path, load: Callable[[sqlite3.Connection], T]
) -> tuple[sqlite3.Connection, T, Quarantine | None]:
    """The spool at `path`, checked, and what `load(db)` read from it. A corrupt file (found by
    the first statement, `quick_check` or `load`) is quarantined and an empty spool opened
    instead."""
    private_dir(path.parent)
    wal_set_aside = _set_aside_a_bad_wal(path)
    db = _connect_private(path)
    try:
        return db, _checked(db, path, load), wal_set_aside
    except (sqlite3.DatabaseError, SpoolCorrupt) as e:
        if not is_corruption(e):
            db.close()
            raise _named(e, path) from e
        reason = str(e)[:300] or type(e).__name__
        # Moved aside while the connection that found the damage is still open: its close
        # ends SQLite's use of the `-wal`, and may delete it (Python 3.10's sqlite3 closes a
        # connection as soon as the error is handled, and the WAL went with it). Once moved,
        # that close can only miss the old names, where nothing new exists yet.
        try:
            quarantine = quarantine_files(path, reason)
        finally:
            db.close()
    except BaseException:
        db.close()
        raise
    db = _connect_private(path)
    try:
        return db, _checked(db, path, load), quarantine
    except BaseException:
        db.close()
        raise


def _checked(db: sqlite3.Connection, path: Path, load: Callable[[sqlite3.Connection], T]) -> T:
    """The spool's settings and tables on `db` (its companions made private), the file
    checked, then what `load` reads from it."""
    prepare(db)
    for suffix in COMPANIONS:
        tighten(path.with_name(path.name + suffix), FILE_MODE)
    quick_check(db)
    return load(db)


def _set_aside_a_bad_wal(path: Path) -> Quarantine | None:
    """A `-wal` left by a crash whose header is not a WAL's (which SQLite would discard
    unread) moved aside with its `-shm`, before SQLite opens the database."""
    wal = path.with_name(path.name + "-wal")
    try:
        with open(wal, "rb") as f:
            header = f.read(WAL_HEADER_BYTES)
    except FileNotFoundError:
        return None
    if len(header) < WAL_HEADER_BYTES or header[:4] in WAL_MAGIC:
        return None
    reason = f"{wal.name}: its header is not a write-ahead log's"
    return quarantine_files(path, reason, COMPANIONS)


def quick_check(db: sqlite3.Connection) -> None:
    """Raise SpoolCorrupt unless `PRAGMA quick_check` finds the file sound."""
    rows = db.execute("PRAGMA quick_check(5)").fetchall()
    found = [str(row[0]) for row in rows]
    if found != ["ok"]:
        raise SpoolCorrupt("quick_check: " + "; ".join(found)[:280])


def quarantine_files(
    path: Path, reason: str, suffixes: tuple[str, ...] = ("", *COMPANIONS)
) -> Quarantine:
    """Move the database and its `-wal`/`-shm` (`suffixes`: those of them) aside as
    `NAME.corrupt-<UTC time>[-wal|-shm]` (SQLite's naming: `sqlite3 NAME.corrupt-...` opens
    the copy with its WAL); the Quarantine names the first moved."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while any(target.with_name(target.name + s).exists() for s in ("", *COMPANIONS)):
        target = path.with_name(f"{path.name}.corrupt-{stamp}.{n}")
        n += 1
    first = None
    for suffix in suffixes:
        source = path.with_name(path.name + suffix)
        if source.exists():
            moved = target.with_name(target.name + suffix)
            source.replace(moved)
            tighten(moved, FILE_MODE)
            first = first or moved
    fsync_dir(path.parent)
    kept = "" if "" in suffixes else " (the database itself is sound: kept)"
    log.warning(
        "spool: %s is corrupt (%s); moved aside as %s%s",
        path,
        reason,
        first or target,
        kept or ", starting with an empty spool",
    )
    return Quarantine(first or target, reason)


def _connect_private(path: Path) -> sqlite3.Connection:
    """`connect` on a file created 0600 first: SQLite gives its `-wal` and `-shm` the
    database file's mode, so all three stay private whatever the umask."""
    private_file(path)
    try:
        return connect(path)
    except sqlite3.Error as e:
        raise _named(e, path) from e


def _named(error: sqlite3.Error | SpoolCorrupt, path: Path) -> Exception:
    """`error` again, its message naming the file (and, where it is the disk's, that)."""
    disk = any(word in str(error) for word in DISK_WORDS)
    hint = " (is its disk full, or read-only?)" if disk else ""
    return type(error)(f"the spool {path}: {error}{hint}")
