"""An admitted request on its way through the scheduler and the runner.

Ingress makes a :class:`Job` once a request has been read and checked; the scheduler queues
it; the runner leases the model, runs it and answers it through its :class:`ReplyStream`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.inference.reply_stream import ReplyStream
from agent.protocol.requests import Request


class Cancelled(Exception):
    """The agent is stopping and this request could not finish in time."""


class CancelFlag:
    """Set once, when the agent stops, to end a request between runs of its model. Only ever
    polled, never waited on: a plain flag, not a `threading.Event` (one per request)."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


@dataclass(eq=False)  # identity, so jobs can sit in a set
class Job:
    """One request: what it asks, where its replies go, when it arrived."""

    request: Request
    reply: ReplyStream
    received: float  # monotonic
    cancelled: CancelFlag = field(default_factory=CancelFlag)
    # The inputs as checked at ingress against this version: no second check if it runs on it.
    checked: tuple[int, dict[str, Any]] | None = None
    payload_bytes: int = 0  # the request's size on the wire
