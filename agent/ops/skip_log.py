"""Skipped readings, counted, and logged once per key: a sensor that keeps failing is logged
the first time only (agent.ops.jetson, agent.ops.nvml)."""

from __future__ import annotations

import logging


class SkipLog:
    """`skip()` counts one skipped reading (`count`) and logs `message` the first time `key`
    is skipped, as a warning on `log`."""

    def __init__(self, log: logging.Logger) -> None:
        self.count = 0
        self._log = log
        self._keys: set[str] = set()

    def skip(self, key: str, message: str, *args: object) -> None:
        """Count one skip; log it (`message % args`) unless `key` was logged before."""
        self.count += 1
        if key not in self._keys:
            self._keys.add(key)
            self._log.warning(message, *args)
