"""The agent's plain counters: requests received, rejected by code, answered, dropped...

Counted from any thread (network, workers, spool writer), read by telemetry, metrics and
tests. One lock, held for an increment only.
"""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    """`add(name)` from any thread; `counters[name]` (0 when never counted); `snapshot()`."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def __getitem__(self, name: str) -> int:
        return self._counts.get(name, 0)

    def get(self, name: str, default: int = 0) -> int:
        return self._counts.get(name, default)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
