"""The persisted `seq` of a source's stream (docs/protocol.md, "Local sources")."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from agent.config.state_files import write_atomic
from agent.delivery.outbox import OutboxClosed
from agent.sources.base import SourceError

log = logging.getLogger(__name__)


class SeqStore:
    """The next `seq` of a source's stream, kept across restarts and crashes.

    The file holds a bound B such that every seq ever used is below B. Before a seq at or
    above the stored bound is used, B = seq + 1 + `reserve` is written (atomically: temp
    file, fsync, rename), so a crash costs at most `reserve` unused numbers and never reuses
    one; a clean stop writes the exact next seq, so a restart continues without a gap. After
    `close()` no seq is handed out any more: a worker still running past the drain timeout
    cannot publish a number the next run will use again.
    """

    def __init__(self, path: Path, reserve: int) -> None:
        self.path = path
        self.reserve = reserve
        self._lock = threading.Lock()
        self._closed = False
        self.start = self._read()
        self.bound = self.start  # seqs below this are covered by the file

    def _read(self) -> int:
        try:
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as e:
            raise SourceError(f"cannot read {self.path}: {e}") from None
        if not text.isdigit() or len(text) > 19:
            raise SourceError(
                f"{self.path} does not hold a seq ({text[:40]!r}); delete it to restart the "
                "stream's numbering at 0 (subscribers will see seq restart)"
            )
        return int(text)

    def ensure(self, upto: int) -> None:
        """Seqs below `upto` are about to be used: the file must cover them first."""
        with self._lock:
            if self._closed:
                raise OutboxClosed  # the agent is stopping: nothing more is numbered
            if upto > self.bound:
                bound = upto + self.reserve
                self._write(bound)
                self.bound = bound

    def close(self, next_seq: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._write(next_seq)
            except OSError as e:  # the reserved bound stays: a gap, never a reuse
                log.error("source: cannot save %s: %s", self.path, e)

    def _write(self, value: int) -> None:
        """Temp file, fsync, rename, folder fsync; folder 0700, file 0600 whatever the umask."""
        write_atomic(self.path, f"{value}\n".encode("ascii"))
