"""Shared by the spool tests: the spool's connection, recording what it executes."""

from __future__ import annotations

import sqlite3


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
