"""Requests stored before a crash, run again (decision 0057).

A QoS 1/2 request is stored before the broker gets its acknowledgement; those the spool holds
without a terminal message when the agent starts were cut off by a crash. Each runs again
once, from `seq` 0, at the first connection (`ConnectionHooks`, on the io thread, where
requests are read), its partial stream dropped from the spool first: a subscriber drops what
it already had by (id, seq). A spool that cannot be written (a full or read-only disk) fails
the drop; the hooks try again every tick, and what ran before the failure does not run twice.
It runs on the version its stream began on, handed to the ingress beside the request's own
bytes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agent.delivery.spool import Spool
from agent.mqtt.messages import Incoming

if TYPE_CHECKING:
    from agent.service.ingress import Ingress

log = logging.getLogger(__name__)


class CrashReplay:
    """Call it (again, until it returns without raising) once the broker is connected."""

    def __init__(self, spool: Spool | None, ingress: Ingress) -> None:
        self._spool = spool
        self._ingress = ingress
        # the requests a crash left, read at the start: not those stored since, which run as
        # they arrive
        self._left = {r.key for r in spool.unfinished_requests()} if spool is not None else set()

    def __call__(self) -> None:
        spool = self._spool
        if spool is None or not self._left:
            return
        stored = [r for r in spool.unfinished_requests() if r.key in self._left]
        ran = 0
        try:
            for request in stored:
                version = spool.stream_version(request.key)  # the one it began on
                spool.drop_stream(request.key)  # a full disk: the rest wait for a retry
                self._left.discard(request.key)
                incoming = Incoming(
                    request.topic,
                    request.payload,
                    request.qos,
                    request.response_topic,
                    request.correlation,
                )
                self._ingress.on_message(incoming, replay=True, pin=version)
                ran += 1
        finally:
            if ran:
                log.info("replayed %d stored request(s) that had no terminal message", ran)
