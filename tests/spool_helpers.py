"""Shared by the spool tests: the spool's connection, recording what it executes, and a
started writer over a spool that records."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.delivery.spool import Spool
from agent.delivery.spool_writer import SpoolWriter


class Statements:
    """The spool's connection, recording what it executes."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.executed: list[str] = []

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        self.executed.append(sql)
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def recording(spool: Spool) -> Statements:
    """`spool`'s connection swapped for a `Statements` over it, which is returned."""
    statements = Statements(spool._db)
    spool._db = statements  # type: ignore[assignment]
    return statements


@contextmanager
def recorded_writer(path: Path) -> Iterator[tuple[Spool, Statements, SpoolWriter]]:
    """A spool at `path` (16 MiB, 10,000 messages) recording its statements, and a started
    `SpoolWriter` over it; on leaving, the writer is closed, then the spool, on its own
    connection again."""
    spool = Spool(path, max_bytes=1 << 24, max_messages=10_000)
    statements = recording(spool)
    writer = SpoolWriter(spool, protected_after=lambda: 0, on_written=lambda n, b: None)
    writer.start()
    try:
        yield spool, statements, writer
    finally:
        writer.close()
        spool._db = statements.db
        spool.close()
