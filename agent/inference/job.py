"""An admitted request on its way through the scheduler and the runner.

Ingress makes a :class:`Job` once a request has been read and checked; the scheduler queues
it; the runner leases the model, runs it and answers it through its :class:`ReplyStream`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.inference.reply_stream import ReplyStream
from agent.models.text_inputs import TextBatch
from agent.protocol.requests import Request


class Cancelled(Exception):
    """The agent is stopping and this request could not finish in time, or (`by_request`)
    `ROOT/cancel` asked to end it."""

    def __init__(self, by_request: bool = False) -> None:
        super().__init__("cancelled by request" if by_request else "the agent is stopping")
        self.by_request = by_request


class CancelFlag:
    """Set once, when the agent stops or `ROOT/cancel` names the request (`by_request`), to end
    it between runs of its model. Only ever polled, never waited on: a plain flag, not a
    `threading.Event` (one per request)."""

    __slots__ = ("_set", "by_request")

    def __init__(self) -> None:
        self._set = False
        self.by_request = False

    def set(self, *, by_request: bool = False) -> None:
        if not self._set:
            self.by_request = by_request
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
    # The version's `[[postprocess]]` bound to this request's geometry (agent.inference.images),
    # applied to each piece's outputs; more `timing` keys (an image's decode_ms).
    post: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    timing: dict[str, float] = field(default_factory=dict)
    texts: TextBatch | None = None  # its `prompt`, as tokenized (agent.inference.texts)
