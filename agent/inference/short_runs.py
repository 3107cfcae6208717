"""Which requests are short enough to run on the network thread that received them.

Handing a request to a worker thread costs a wake-up on the request's own path: on a 2-core
box that is a sizeable share of a small request's round trip (see
docs/decisions/0011-short-requests-on-the-network-thread.md). A request whose model answers
in well under a millisecond is cheaper to run where it was decoded. Running it there holds
up everything else that thread does (reading the next request, acknowledgements, keepalive,
publishing the workers' chunks), so only requests known to be short qualify: this keeps, per
model, the version that served it last and a decaying maximum of what one of its requests
cost, in wall time and in messages sent, and of the size of its request payloads. A slow
request raises the estimate at once; fast ones lower it slowly (by `DECAY` of the difference
each), so one fast request after slow ones changes nothing. A payload larger than those seen
scales the expected time with it (a model's run grows with its input). A version not seen
yet (a new model, a hot swap) is never short: its first requests go to the workers and
measure it there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

DECAY = 0.125  # how far a cheaper request moves the estimate towards itself
MAX_MESSAGES = 4  # more messages than this per request: always a worker's job


@dataclass
class _Estimate:
    version: int
    seconds: float
    messages: float
    payload_bytes: float


class ShortRuns:
    """`record()` after each request (any thread); `is_short()` before running one."""

    def __init__(self, max_s: float) -> None:
        """`max_s`: the longest a request may be expected to take to qualify (0: none does)."""
        self.max_s = max_s
        self._estimates: dict[str, _Estimate] = {}
        self._lock = threading.Lock()

    def record(
        self, model: str, version: int, seconds: float, messages: int, payload_bytes: int
    ) -> None:
        """A request of `model` (`payload_bytes` long) ran on `version` for `seconds` and
        sent `messages`."""
        with self._lock:
            estimate = self._estimates.get(model)
            if estimate is None or estimate.version != version:
                self._estimates[model] = _Estimate(version, seconds, messages, payload_bytes)
                return
            estimate.seconds = _decaying_max(estimate.seconds, seconds)
            estimate.messages = _decaying_max(estimate.messages, messages)
            estimate.payload_bytes = _decaying_max(estimate.payload_bytes, payload_bytes)

    def is_short(self, model: str, version: int, payload_bytes: int) -> bool:
        """Whether a request of `model` on `version`, `payload_bytes` long, is expected to take
        at most `max_s` and to send at most MAX_MESSAGES messages."""
        if self.max_s <= 0:
            return False
        estimate = self._estimates.get(model)  # read without the lock: a stale read is harmless
        if estimate is None or estimate.version != version or estimate.messages > MAX_MESSAGES:
            return False
        growth = max(1.0, payload_bytes / max(estimate.payload_bytes, 1.0))
        return estimate.seconds * growth <= self.max_s


def _decaying_max(current: float, sample: float) -> float:
    return sample if sample >= current else current + (sample - current) * DECAY
