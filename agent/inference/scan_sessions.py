"""Scan sessions: a recording streamed as several requests with the same `params.session`.

Between two requests of a session the agent keeps its :class:`ScanCursor` (the samples not
yet in a complete window, and the carried state) for `[scan] session_ttl_s` since its last
use; the next request goes on where the last stopped, window numbers and offsets included.
The rules (docs/protocol.md, "Scan sessions"):

* A session belongs to one model and the version it started on: a request that would run on
  another version (a swap, a pin) is refused (`bad_request`) and the session is dropped, so
  the next request with that id starts a new recording at offset 0.
* One request of a session runs at a time: a second while one runs is refused
  (`bad_request`, "session busy"): the order of the pieces matters, so a backend sends the
  next piece after the previous one's `end` or `result`.
* A request with `params.final = true` ends the session (its tail is flushed as `[scan] tail`
  says); a request that fails ends it too.
* Bounds: at most `max_per_model` idle sessions per model (past it, that model's least
  recently used idle session is dropped) and `max_bytes` of kept samples and state in all
  (past it, the least recently used idle session of any model). An expired or dropped
  session is forgotten: a request naming it starts a new recording (its first chunk has
  `index` 0).

Expiry: every take and give back sweeps the expired sessions of every model, and so does
`expire`, which the agent's housekeeping calls every tick, so a model that went quiet (or was
removed) does not keep its sessions' memory: no thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agent.inference.scan import ScanCursor
from agent.protocol.errors import WireError

__all__ = ["MAX_SESSIONS_PER_MODEL", "MAX_SESSION_BYTES", "ScanSessions"]

MAX_SESSIONS_PER_MODEL = 256
MAX_SESSION_BYTES = 64 * 1024 * 1024  # kept samples and state of every idle session


@dataclass
class _Entry:
    cursor: ScanCursor | None  # None while a request of the session runs (busy)
    version: int
    ttl_s: float
    last_used: float
    nbytes: int = 0


class ScanSessions:
    """The live sessions of every scan model; thread-safe (workers take and give back)."""

    def __init__(
        self,
        *,
        max_per_model: int = MAX_SESSIONS_PER_MODEL,
        max_bytes: int = MAX_SESSION_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_per_model = max_per_model
        self._max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._models: dict[str, OrderedDict[str, _Entry]] = {}
        self._bytes = 0

    def take(
        self, model: str, session: str, version: int, ttl_s: float, fresh: ScanCursor
    ) -> ScanCursor:
        """The session's cursor, marked busy (`fresh` for a new session); WireError
        (bad_request) while another request of it runs or where it began on another
        version (then it is dropped)."""
        now = self._clock()
        with self._lock:
            self._sweep_all(now)
            sessions = self._models.setdefault(model, OrderedDict())
            entry = sessions.get(session)
            if entry is None:
                self._make_room(sessions, self._max_per_model - 1)
                sessions[session] = _Entry(None, version, ttl_s, now)
                return fresh
            if entry.cursor is None:
                raise WireError(
                    "bad_request",
                    f"session busy: a request of session {session!r} is running; send the "
                    "next piece after its end",
                )
            if entry.version != version:
                self._drop(sessions, session)
                raise WireError(
                    "bad_request",
                    f"session {session!r} began on version {entry.version}, this request "
                    f"runs on version {version}: the session was dropped, start it again",
                )
            cursor = entry.cursor
            entry.cursor, entry.last_used = None, now
            self._bytes -= entry.nbytes
            entry.nbytes = 0
            sessions.move_to_end(session)
            return cursor

    def give_back(self, model: str, session: str, cursor: ScanCursor, *, keep: bool) -> None:
        """A request of the session finished: keep its cursor for the next one (`keep`), or
        end the session (final, failed)."""
        now = self._clock()
        with self._lock:
            sessions = self._models.get(model)
            if sessions is None or session not in sessions:
                return  # closed meanwhile
            if not keep:
                self._drop(sessions, session)
            else:
                entry = sessions[session]
                entry.cursor, entry.last_used, entry.nbytes = cursor, now, cursor.nbytes
                self._bytes += entry.nbytes
                sessions.move_to_end(session)
                self._make_room(sessions, self._max_per_model)
            self._sweep_all(now)

    def expire(self) -> None:
        """Drop the expired idle sessions of every model (housekeeping, every tick)."""
        with self._lock:
            self._sweep_all(self._clock())

    def count(self, model: str) -> int:
        """Sessions of `model` (busy ones included)."""
        with self._lock:
            return len(self._models.get(model, ()))

    def close(self) -> None:
        """Forget every session (the agent stops)."""
        with self._lock:
            self._models.clear()
            self._bytes = 0

    # -- under the lock ----------------------------------------------------------------------

    def _sweep_all(self, now: float) -> None:
        """`_sweep` of every model; a model left with no session is forgotten."""
        for model, sessions in list(self._models.items()):
            self._sweep(sessions, now)
            if not sessions:
                del self._models[model]

    def _sweep(self, sessions: OrderedDict[str, _Entry], now: float) -> None:
        """Drop the expired idle sessions, oldest first (stops at the first one still live)."""
        for name in list(sessions):
            entry = sessions[name]
            if now - entry.last_used <= entry.ttl_s:
                break
            if entry.cursor is not None:
                self._drop(sessions, name)

    def _make_room(self, sessions: OrderedDict[str, _Entry], most: int) -> None:
        """Drop least recently used idle sessions: of this model until at most `most` remain,
        of any model until the kept bytes are within the bound."""
        for name in list(sessions):
            if len(sessions) <= most:
                break
            if sessions[name].cursor is not None:
                self._drop(sessions, name)
        if self._bytes > self._max_bytes:
            idle = [
                (entry.last_used, name, held)
                for held in self._models.values()
                for name, entry in held.items()
                if entry.cursor is not None
            ]
            for _, name, held in sorted(idle, key=lambda item: item[0]):
                if self._bytes <= self._max_bytes:
                    break
                self._drop(held, name)
        if len(sessions) > most:
            raise WireError(
                "bad_request",
                f"too many scan sessions at once (at most {self._max_per_model} per model)",
            )

    def _drop(self, sessions: OrderedDict[str, _Entry], name: str) -> None:
        entry = sessions.pop(name)
        self._bytes -= entry.nbytes
