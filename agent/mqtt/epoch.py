"""The connection epoch: a number on disk that grows with every connection.

The will and the birth message carry it, so a subscriber can tell a late will of an older
connection from the current state.
"""

from __future__ import annotations

from pathlib import Path


class EpochStore:
    """A counter on disk that grows with every connection, across restarts and power cuts.

    A wall clock would not do: a Jetson without an RTC battery boots in 1970 until NTP runs.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            self._value = int(path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            self._value = 0

    @property
    def value(self) -> int:
        return self._value

    def next(self) -> int:
        return self._value + 1

    def commit(self, value: int) -> None:
        """Make `value` the current epoch, atomically (written aside, then renamed)."""
        self._value = value
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(f"{value}\n")
        tmp.replace(self._path)
