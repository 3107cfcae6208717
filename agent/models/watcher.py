"""Turns file events in the model repository into `ModelManager.sync()` calls.

A watchdog observer (inotify on Linux) reports changes; they are debounced (a `cp` of an
engine is hundreds of write events) and a sync runs on this module's own thread, so loading
and warming up a new version never happens on the network or a worker thread. Where inotify
does not work (network mounts, some container setups) watchdog's polling observer is used.
A periodic rescan is the backstop for any event that was lost; syncs are idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Literal, Protocol

from watchdog.events import FileSystemEventHandler

from agent.threads import NamedThread, name_thread

log = logging.getLogger(__name__)

# The thread that reads inotify's descriptor, by watchdog's class name: one a process from
# watchdog 7 (Python 3.11+), one an emitter in watchdog 6 (what Python 3.10 gets).
INOTIFY_READERS = ("InotifyFD", "InotifyBuffer")
# The thread watchdog 7.1+'s InotifyFD starts to parse what it read and hand it on.
INOTIFY_DISPATCHER = "InotifyFD-Dispatcher"
DISPATCHER_WAIT_S = 0.1  # it starts from the reader's own thread, just after the reader
# The readers whose dispatcher is named: one reader serves every watcher of the process (a
# later watcher does not wait for a thread already renamed), a new one gets its own.
_PARSERS_NAMED: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

WatchMode = Literal["auto", "inotify", "poll", "off"]


class Syncable(Protocol):
    def sync(self) -> float | None: ...

    def recheck_s(self) -> float | None: ...

    def mark_complete(self, version_folder: Path) -> None: ...


class RepositoryWatcher:
    """`start()` then `close()`. Thread `model-watcher` runs every sync after the first."""

    def __init__(
        self,
        root: Path,
        manager: Syncable,
        *,
        mode: WatchMode = "auto",
        debounce_s: float = 0.2,
        poll_interval_s: float = 1.0,
        rescan_s: float = 30.0,
    ) -> None:
        self._root = root
        self._manager = manager
        self._mode = mode
        self._debounce_s = debounce_s
        self._poll_interval_s = poll_interval_s
        self._rescan_s = rescan_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_event = 0.0
        self._observer: Any = None
        self.backend = "off"
        self.syncs = 0
        self._thread = NamedThread(target=self._run, name="model-watcher", daemon=True)

    def start(self) -> None:
        if self._mode != "off":
            self._observer = self._start_observer()
        self._thread.start()

    def _start_observer(self) -> Any:
        from watchdog.observers import Observer
        from watchdog.observers.polling import PollingObserver

        handler = _Handler(self)
        if self._mode in ("auto", "inotify"):
            try:
                observer = Observer()
                observer.schedule(handler, str(self._root), recursive=True)
                observer.start()
                _name_threads(observer)
                self.backend = type(observer).__name__
                return observer
            except OSError as e:
                if self._mode == "inotify":
                    raise
                log.warning("watcher: native file events unavailable (%s); polling instead", e)
        observer = PollingObserver(timeout=self._poll_interval_s)
        observer.schedule(handler, str(self._root), recursive=True)
        observer.start()
        _name_threads(observer)
        self.backend = "PollingObserver"
        return observer

    def notify(self, moved_in: Path | None = None) -> None:
        """A change happened (called from the observer's thread)."""
        if moved_in is not None:
            self._manager.mark_complete(moved_in)
        self._last_event = time.monotonic()
        self._wake.set()

    def _run(self) -> None:
        next_due = self._next_look(None)
        while not self._stop.is_set():
            woke = self._wake.wait(max(0.0, next_due - time.monotonic()))
            if self._stop.is_set():
                return
            if woke:
                self._debounce()
                self._wake.clear()
            try:
                again = self._manager.sync()
            except Exception:
                log.exception("watcher: sync failed")
                again = None
            self.syncs += 1
            next_due = self._next_look(again)

    def _next_look(self, again: float | None) -> float:
        """When the next sync is due without an event: the rescan, or sooner where the last
        sync asked for it (`again`: files settling) or the manager does (`recheck_s`: a failed
        version, whose fix's event may never come)."""
        waits = [self._rescan_s, again, self._manager.recheck_s()]
        return time.monotonic() + min(w for w in waits if w is not None)

    def _debounce(self) -> None:
        """Wait until no event came for `debounce_s` (at most 10 debounce periods)."""
        limit = time.monotonic() + 10 * self._debounce_s
        while not self._stop.is_set():
            quiet = time.monotonic() - self._last_event
            if quiet >= self._debounce_s or time.monotonic() >= limit:
                return
            self._stop.wait(self._debounce_s - quiet)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(5)
        if self._thread.is_alive():
            self._thread.join(5)


def _name_threads(observer: Any) -> None:
    """watchdog's threads, once started, named for what they serve, in Python and in the
    kernel (`agent.threads.name_thread`), so that thread listings (py-spy, `top -H`) say whose
    they are: its dispatching thread, its emitters (one per watched folder) and, with
    inotify, the thread that reads the inotify descriptor and the one that parses what it
    read (watchdog 7.1+)."""
    name_thread(observer, "model-watcher-events", "watcher-events")
    for emitter in observer.emitters:
        name_thread(emitter, "model-watcher-emitter", "watcher-emitter")
    readers = [t for t in threading.enumerate() if type(t).__name__ in INOTIFY_READERS]
    for reader in readers:
        name_thread(reader, "model-watcher-inotify", "watcher-inotify")
        if hasattr(reader, "_dispatch_raw_buffers") and reader not in _PARSERS_NAMED:
            dispatcher = _await_thread(INOTIFY_DISPATCHER, DISPATCHER_WAIT_S)
            if dispatcher is not None:
                name_thread(dispatcher, "model-watcher-inotify-parse", "watcher-parse")
                _PARSERS_NAMED.add(reader)


def _await_thread(name: str, timeout_s: float) -> threading.Thread | None:
    """The running thread called `name`, waiting up to `timeout_s` for it to start."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = next((t for t in threading.enumerate() if t.name == name), None)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.001)


class _Handler(FileSystemEventHandler):  # type: ignore[misc, unused-ignore]
    """Every change under the repository wakes the watcher; reads do not."""

    def __init__(self, watcher: RepositoryWatcher) -> None:
        super().__init__()
        self._watcher = watcher

    def dispatch(self, event: Any) -> None:
        moved_in = None
        if getattr(event, "event_type", "") == "moved" and getattr(event, "is_directory", False):
            dest = Path(str(event.dest_path))
            if dest.name.isdigit():
                moved_in = dest
        if getattr(event, "event_type", "") in ("opened", "closed_no_write"):
            return  # reads (our own loads) are not changes
        self._watcher.notify(moved_in)
