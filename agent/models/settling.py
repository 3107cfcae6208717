"""When a version's files count as complete, so that nothing half-copied is ever loaded.

A version folder renamed into place (the watcher reports the move) is complete at once.
One written in place (``cp`` into ``models/NAME/3/``) is complete once its newest mtime is
``settle_s`` old and its model file's fingerprint (size, mtime) has not changed since the
previous look; until then a lower ready version keeps serving and the manager asks for
another sync after the seconds :meth:`SettleTracker.finish_round` returns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

from agent.models.records import Fingerprint, VersionRecord
from agent.models.repository import VersionInfo, file_fingerprint, resolved

__all__ = ["SettleTracker", "fingerprint_of", "warn_if_replaced"]

log = logging.getLogger(__name__)


class SettleTracker:
    """Per-version settle state across syncs. One sync (round) at a time: the manager calls
    :meth:`start_round`, :meth:`settled` per candidate, then :meth:`finish_round`;
    :meth:`mark_complete` may come from any thread."""

    def __init__(self, settle_s: float) -> None:
        self._settle_s = settle_s
        self._lock = threading.Lock()  # guards _complete (the watcher thread adds to it)
        self._complete: set[Path] = set()  # version folders renamed into place
        self._seen: dict[tuple[str, int], tuple[Fingerprint | None, float]] = {}
        self._first_round = True
        self._next_check: float | None = None

    def mark_complete(self, version_folder: Path) -> None:
        """A version folder was renamed into place: its files are complete at once (an empty
        one is not: its files are still to be copied in, and settle as any)."""
        folder = resolved(version_folder)
        with contextlib.suppress(OSError):
            if folder is not None and any(folder.iterdir()):
                with self._lock:
                    self._complete.add(folder)

    def forget(self, version_folder: Path) -> None:
        """The version folder is gone: one made again under its name settles as any."""
        folder = resolved(version_folder)
        with self._lock:
            self._complete.discard(folder)
        if version_folder.name.isdigit():  # the watcher's thread never touches `_seen`
            self._seen.pop((version_folder.parent.name, int(version_folder.name)), None)

    def forget_model(self, name: str) -> None:
        """The model's folder is gone: what was seen of its versions goes with it."""
        for key in [key for key in self._seen if key[0] == name]:
            del self._seen[key]

    def start_round(self) -> None:
        self._next_check = None

    def finish_round(self) -> float | None:
        """Seconds until a version still settling should be looked at again, else None."""
        self._first_round = False
        return self._next_check

    def settled(self, version: VersionInfo, fingerprint: Fingerprint | None) -> bool:
        """Files count as complete once renamed into place, or unchanged for `settle_s`.

        The newest mtime of the version's files must be `settle_s` old, and the fingerprint
        the same as at the previous look (a write in between restarts the wait).
        """
        folder = resolved(version.path)
        with self._lock:
            if folder in self._complete:
                return True
        key = (version.model, version.version)
        stamp = _newest_mtime(version.path)
        now = time.time()
        previous = self._seen.get(key)
        self._seen[key] = (fingerprint, stamp)
        age = now - stamp
        if age >= self._settle_s and previous is not None and previous == (fingerprint, stamp):
            return True
        if age >= self._settle_s and previous is None and self._first_round:
            return True  # present and untouched when the agent started
        wait = max(self._settle_s - age, 0.05) if age < self._settle_s else 0.05
        self._next_check = wait if self._next_check is None else min(self._next_check, wait)
        return False


def fingerprint_of(version: VersionInfo) -> Fingerprint | None:
    """The model file's size and the newest mtime (ns) of it, the version folder and the
    files in it; None without a readable model file. A failed version is retried when this
    changes, so the folder counts too: a `model.sig` copied after the model, a file added
    or removed, or a side file fixed in place brings the version back (agent.models.trust)."""
    if version.model_file is None:
        return None
    try:
        size, mtime_ns = file_fingerprint(version.model_file)
        changed_ns = version.model_file.stat().st_ctime_ns  # a chmod that mends it, too
    except OSError:
        return None
    return size, max(mtime_ns, changed_ns, _newest_mtime_ns(version.path))


def warn_if_replaced(model: str, entry: VersionRecord, fingerprint: Fingerprint | None) -> None:
    """A loaded version's files changed in place (its fingerprint is not the one it was
    loaded with): it keeps serving what it loaded, and the next start loads the new files.
    Warned once for each change."""
    if entry.fingerprint in (None, fingerprint) or entry.changed_files == fingerprint:
        return
    entry.changed_files = fingerprint
    version = entry.loaded.version if entry.loaded is not None else "?"
    log.warning(
        "model %s v%s: its files changed while it is loaded; it serves what it loaded, and "
        "the next start loads the new files: put a new version in a folder of its own to "
        "swap it in now",
        model,
        version,
    )


def _newest_mtime_ns(folder: Path) -> int:
    newest = 0
    with contextlib.suppress(OSError):
        newest = folder.stat().st_mtime_ns
        for child in folder.iterdir():
            with contextlib.suppress(OSError):
                newest = max(newest, child.stat().st_mtime_ns)
    return newest


def _newest_mtime(folder: Path) -> float:
    """The latest modification time of a version folder and the files in it."""
    newest = 0.0
    try:
        newest = folder.stat().st_mtime
        for child in folder.iterdir():
            try:
                newest = max(newest, child.stat().st_mtime)
            except OSError:
                continue
    except OSError:
        pass
    return newest
