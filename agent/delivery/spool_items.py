"""What goes into the spool and comes out of it: the rows read back (`SpooledMessage`,
`StoredRequest`), what an eviction dropped, the items of a write batch (a message, a request
to store or to forget, a callback after the write), and the rules that decide how much of a
batch is written now (`settled_prefix`, `unacknowledged_tail`) and whether its commit needs an
fsync (`settlement`).

Plain data and pure functions: the `Spool` (agent.delivery.spool) writes them, the spool
writer (agent.delivery.spool_writer) batches them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from agent.delivery.out_message import OutMessage

if TYPE_CHECKING:
    from agent.delivery.spool import Spool


@dataclass(frozen=True)
class SpooledMessage:
    id: int
    stream: str
    topic: str
    payload: bytes
    qos: int
    retain: bool
    correlation: bytes | None

    def message(self, make_properties: Callable[[bytes], Any] | None) -> OutMessage:
        """The row as a message to publish again; `make_properties`: its MQTT 5 properties
        from the correlation data kept with it."""
        properties = (
            make_properties(self.correlation)
            if self.correlation is not None and make_properties is not None
            else None
        )
        return OutMessage(
            self.topic,
            self.payload,
            self.qos,
            self.retain,
            properties,
            stream=self.stream,
            spool_id=self.id,
            correlation=self.correlation,
        )


@dataclass(frozen=True)
class StoredRequest:
    key: str
    topic: str
    payload: bytes
    qos: int
    response_topic: str | None
    correlation: bytes | None


@dataclass(frozen=True)
class Eviction:
    streams: tuple[str, ...]
    messages: int
    bytes: int


class MessageRow(Protocol):
    """A queued message as the spool stores it (`agent.delivery.outbox.OutMessage` is one)."""

    @property
    def spool_id(self) -> int | None: ...
    @property
    def stream(self) -> str | None: ...
    @property
    def topic(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def qos(self) -> int: ...
    @property
    def retain(self) -> bool: ...
    @property
    def correlation(self) -> bytes | None: ...
    @property
    def finishes(self) -> str | None: ...
    @property
    def rid(self) -> str | None: ...
    @property
    def seq(self) -> int | None: ...


@dataclass(frozen=True)
class StoreRequest(StoredRequest):
    """Store a received request; `on_stored` runs once it is on disk (fsynced), `on_failed`
    (with a reason: the disk is full, the spool cannot be written) when its batch could not
    be written: the request is then not stored and never retried."""

    on_stored: Callable[[], None] | None = None
    on_failed: Callable[[str], None] | None = None
    queued_at: float = field(default_factory=time.monotonic, compare=False)


@dataclass(frozen=True)
class FinishRequest:
    """Forget a stored request (its terminal message went out without touching the disk)."""

    key: str


@dataclass(frozen=True)
class AfterWrite:
    """Run `callback(spool)` on the writer thread once everything queued before is written."""

    callback: Callable[[Spool], None]


WriteItem = MessageRow | StoreRequest | FinishRequest | AfterWrite


def request_key(model: str, request_id: str) -> str:
    return f"{model}/{request_id}"


def settled_prefix(
    items: Sequence[WriteItem], acks: Sequence[int], now: float, grace_s: float
) -> int:
    """How many of `items` (in order) to write now. All of them, unless a request stored among
    them is not settled yet (unanswered, or a reply the broker has not acknowledged) and was
    queued less than `grace_s` ago: then the batch ends before it, where every request stored
    in the batch is settled, so its commit needs no fsync, and the rest waits for the next
    batch (by then a fast request is answered and needs no fsync either). A request that is
    older and still unsettled needs the disk anyway: everything is written, and fsynced."""
    acked = set(acks)
    cut = len(items)
    while True:
        unsettled, _ = settlement(items, cut, acked)
        if not unsettled:
            return cut
        position, queued_at = min(unsettled)
        if now - queued_at >= grace_s:
            return len(items)
        cut = position  # its stores' answers may lie past the new end: look again


def unacknowledged_tail(
    items: Sequence[WriteItem], acks: Sequence[int], held_up_to: int, limit: int
) -> int:
    """How many of `items` (in order) to write now so that messages the broker has not
    acknowledged yet wait for the next batch, by when it usually has: written once, as
    acknowledged, not inserted now and marked later (which costs about half a row more).

    The batch ends before the first unacknowledged message among its last `limit` items
    when only messages follow it; a message is held back once (ids up to `held_up_to` were),
    and never from a batch that stores a request (its fsync rule reads the whole batch)."""
    acked = set(acks)
    cut = len(items)
    for position in range(len(items) - 1, max(-1, len(items) - limit - 1), -1):
        item = items[position]
        if isinstance(item, (StoreRequest, FinishRequest, AfterWrite)):
            break
        if item.spool_id is not None and item.spool_id not in acked:
            if item.spool_id <= held_up_to:
                break
            cut = position
    if cut < len(items) and any(isinstance(item, StoreRequest) for item in items):
        return len(items)
    return cut


def settlement(
    items: Sequence[WriteItem], end: int, acked: set[int]
) -> tuple[list[tuple[int, float]], set[str]]:
    """The rule a commit is fsynced by. For `items[:end]`: the (position, queue time) of each
    request stored there and not settled within them (unanswered, or a message of its stream
    the broker has not acknowledged), and the streams with such a message."""
    answered: dict[str, bool] = {}
    stored: dict[str, tuple[int, float]] = {}
    streams: set[str] = set()
    for position in range(end):
        item = items[position]
        if isinstance(item, StoreRequest):
            answered[item.key] = False
            stored[item.key] = (position, item.queued_at)
        elif isinstance(item, FinishRequest):
            if item.key in answered:
                answered[item.key] = True
        elif not isinstance(item, AfterWrite):
            if item.spool_id not in acked and item.stream is not None:
                streams.add(item.stream)
            if item.finishes is not None and item.finishes in answered:
                answered[item.finishes] = True
    unsettled = [stored[key] for key, done in answered.items() if not done or key in streams]
    return unsettled, streams
