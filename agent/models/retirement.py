"""The end of a version's life: retired, drained, closed, forgotten.

Retiring a version only marks it (invariant 1 of :mod:`agent.models.manager`): it stops
being served, and the last lease to end closes it. A version still leased after the drain
timeout is closed anyway (`reap`): a request that holds it that long is stuck, and its next
run fails with `model_error` rather than keeping the memory of a replaced version forever.

:class:`Retirement` works on the manager's records under the manager's lock; the manager
calls it from `sync()` (trim, remove), from a lease's end (close) and from its timer (reap).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent.models.records import Event, LoadedVersion, ModelRecord, loaded_versions

log = logging.getLogger(__name__)


class Retirement:
    """Retires, closes and forgets versions of the manager's `models` (guarded by `lock`)."""

    def __init__(
        self,
        lock: threading.Lock,
        models: dict[str, ModelRecord],
        *,
        on_event: Callable[[Event], None],
        on_inventory: Callable[[], None],
        drain_timeout_s: float,
    ) -> None:
        self._lock = lock
        self._models = models
        self._on_event = on_event
        self._on_inventory = on_inventory
        self.drain_timeout_s = drain_timeout_s

    def trim(self, record: ModelRecord, keep_older: int) -> bool:
        """Keep the serving version and `keep_older` older ready ones loaded; retire the rest.
        True when a version was retired."""
        serving = record.serving.version if record.serving else None
        ready = sorted(
            (n for n, e in record.versions.items() if e.state == "ready" and n != serving),
            reverse=True,
        )
        older = [n for n in ready if serving is None or n < serving]
        keep = set(older[:keep_older])
        changed = False
        for number in ready:
            if number not in keep:
                self.retire(record, number, removed=False)
                changed = True
        return changed

    def retire(self, record: ModelRecord, number: int, *, removed: bool) -> None:
        """Stop serving version `number`; close it now if no lease holds it. `removed`: its
        folder is gone, so its record goes too once it is closed."""
        close = None
        with self._lock:
            entry = record.versions.get(number)
            if entry is None:
                return
            loaded = entry.loaded
            entry.removed = entry.removed or removed
            if loaded is not None and record.serving is loaded:
                record.serving = None
            if loaded is not None:
                if not loaded.retired:
                    loaded.retired, loaded.retired_at = True, time.monotonic()
                entry.state = "draining"
                if loaded.leases == 0 and not loaded.closed:
                    loaded.closed = True
                    close = loaded
            elif removed:
                del record.versions[number]
        if close is not None:
            self.close_version(close)

    def close_version(self, loaded: LoadedVersion) -> None:
        """Free a version's memory now (never left to the garbage collector). The caller
        marked it `closed` under the lock, so this runs once a version."""
        try:
            loaded.close_sessions()
        except Exception:
            log.exception("model %s v%d: close failed", loaded.model, loaded.version)
        with self._lock:
            record = self._models.get(loaded.model)
            entry = record.versions.get(loaded.version) if record else None
            if entry is not None and entry.loaded is loaded:
                entry.loaded = None
                entry.state = "unloaded"
                if entry.removed and record is not None:
                    del record.versions[loaded.version]
        log.info("model %s v%d unloaded", loaded.model, loaded.version)
        self._on_event({"type": "model_unloaded", "model": loaded.model, "version": loaded.version})
        self._on_inventory()

    def remove_model(self, name: str) -> None:
        """The model's folder is gone: every version retired, the model forgotten once none
        is loaded any more."""
        record = self._models[name]
        for number in list(record.versions):
            self.retire(record, number, removed=True)
        with self._lock:
            if not any(e.loaded for e in record.versions.values()):
                del self._models[name]
        self._on_inventory()

    def reap(self) -> None:
        """Close retired versions still leased after the drain timeout."""
        now = time.monotonic()
        with self._lock:
            overdue = [
                loaded
                for loaded in loaded_versions(self._models)
                if loaded.retired
                and not loaded.closed
                and now - loaded.retired_at >= self.drain_timeout_s
            ]
            for loaded in overdue:
                loaded.closed = True
        for loaded in overdue:
            log.warning(
                "model %s v%d: %d request(s) still hold it after the %.0f s drain timeout; closing",
                loaded.model,
                loaded.version,
                loaded.leases,
                self.drain_timeout_s,
            )
            self.close_version(loaded)
