"""The connection epoch: a number on disk that grows with every connection.

The will and the birth message carry it, so a subscriber can tell a late will of an older
connection from the current state. It must never move backwards: a subscriber that saw epoch
E takes anything below E for stale. So it is kept twice (`epoch` and `epoch.backup` in
`state_dir`, each written aside, fsynced and renamed, one after the other), and read as the
highest readable copy. When neither can be read (garbage, an empty file of a lost write),
the epoch continues from the wall clock (seconds since 2020), but only once the clock is
plausibly set: see `clock_floor`. A WARNING and an `EpochRecovery` (published by the agent as
the `epoch_recovered` event) say what happened.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.config.state_files import FILE_MODE, tighten, write_atomic

log = logging.getLogger(__name__)

CLOCK_ORIGIN = 1_577_836_800  # 2020-01-01T00:00:00Z: the clock floor counts from here
# A clock before 2025-01-01 was not set: a Jetson without an RTC battery boots in 1970 (or at
# its image's build date) until NTP runs. A floor is only taken from a clock past this.
PLAUSIBLE_CLOCK = 1_735_689_600
MAX_DIGITS = 19  # an int64


@dataclass(frozen=True)
class EpochRecovery:
    """The epoch file could not be read: where the epoch came from instead."""

    path: Path
    reason: str  # what was wrong with the file
    source: str  # "backup" (the second copy), "clock" (the clock floor), "none" (not yet)
    epoch: int  # the epoch recovered; the next connection uses the one after it


def read_epoch(path: Path) -> tuple[int | None, str | None]:
    """The number in `path`, or None and why not ("missing", "unreadable: ...", "garbage")."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable: {e.strerror or e}"
    text = raw.strip()
    if not text.isdigit() or len(text) > MAX_DIGITS:
        return None, f"garbage: {raw[:40]!r}"
    return int(text), None


def clock_floor(now: float) -> int | None:
    """Seconds since 2020 by a clock that is plausibly set, else None.

    Why it never goes backwards relative to what subscribers saw: an epoch grows by one per
    connection, and reconnects back off (a second at least), so an agent that counted from 0
    has not passed the seconds since 2020 (about 1.6e8 by 2025); one that already continued
    from a floor grew by at most one a second since, so a later floor is higher still.
    """
    if now < PLAUSIBLE_CLOCK:
        return None
    return int(now) - CLOCK_ORIGIN


class EpochStore:
    """A counter on disk that grows with every connection, across restarts and power cuts.

    A wall clock alone would not do: a Jetson without an RTC battery boots in 1970 until NTP
    runs. `recovery` is set when the file could not be read.
    """

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self._path = path
        self._backup = path.with_name(f"{path.name}.backup")
        self._clock = clock
        self._floor_pending = False  # nothing readable and no plausible clock yet
        self.recovery: EpochRecovery | None = None
        self._value = self._load()
        for copy in (path, self._backup):
            tighten(copy, FILE_MODE)

    def _load(self) -> int:
        primary, problem = read_epoch(self._path)
        backup, backup_problem = read_epoch(self._backup)
        readable = [v for v in (primary, backup) if v is not None]
        if problem is None or (problem == "missing" and backup_problem == "missing"):
            if backup_problem not in (None, "missing"):
                log.warning(
                    "epoch: %s is %s; rewritten at the next connection",
                    self._backup,
                    backup_problem,
                )
            return max(readable, default=0)
        assert problem is not None
        if readable:
            value, source = max(readable), "backup"
        else:
            floor = clock_floor(self._clock())
            self._floor_pending = floor is None
            value, source = (0, "none") if floor is None else (floor, "clock")
        self.recovery = EpochRecovery(self._path, problem, source, value)
        log.warning(
            "epoch: %s is %s; continuing from %d (%s)",
            self._path,
            problem,
            value,
            {
                "backup": f"the copy in {self._backup.name}",
                "clock": "seconds since 2020 by the wall clock",
                "none": "no readable copy and the clock is not set yet: the clock floor is "
                "taken at the first connection once it is",
            }[source],
        )
        return value

    @property
    def value(self) -> int:
        return self._value

    def next(self) -> int:
        """The epoch of the next connection."""
        if self._floor_pending:
            floor = clock_floor(self._clock())
            if floor is not None:
                self._floor_pending = False
                if floor > self._value:
                    log.warning("epoch: the clock is set now; continuing from %d", floor)
                    self._value = floor
        return self._value + 1

    def commit(self, value: int) -> None:
        """Make `value` the current epoch: both copies written aside, fsynced and renamed, one
        after the other (a power cut leaves at least one of them whole). Where that fails (a
        full disk has no block for the new file), the copy is overwritten in place: its
        digits are zero-padded to a fixed width, so the old file's own blocks hold the new
        number, and the epoch on disk keeps up with the one announced (else the next start
        would go back below it). A disk that takes neither is logged, never raised: the
        connection goes on with the epoch in memory."""
        self._value = value
        data = f"{value:0{MAX_DIGITS}d}\n".encode("ascii")
        for copy in (self._path, self._backup):
            try:
                write_atomic(copy, data)
            except OSError as e:
                if not _overwrite(copy, data):
                    log.error("epoch: cannot write %s: %s", copy, e.strerror or e)


def _overwrite(path: Path, data: bytes) -> bool:
    """`data` written over `path`'s own bytes (no new block: the file is as long already),
    fsynced; False where it cannot be."""
    try:
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_size < len(data):
                return False
            f.write(data)
            f.truncate(len(data))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True
