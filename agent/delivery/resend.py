"""Application-level resend: `ROOT/resend` asks for messages of a recent stream again.

MQTT's QoS is hop by hop: a broker that crashes after acknowledging, or a subscriber that was
away without a persistent session, loses messages no client-side spool can bring back. The
spool keeps every QoS 1/2 message for the resend window (bounded by age and bytes) after the
broker acknowledged it; this module answers resend requests from it, byte for byte, on the
stream's reply topic, or with one `gone` message when the stream is no longer held.

Resend requests are outside input: size-limited, validated (integers within SQLite's 64
bits), and rate-limited by token buckets so that a flood of them cannot starve live streams
nor grow the process: asks a second, messages a second, and payload bytes a second; only the
payloads the buckets allow are read from the spool, and the outbox's resend lane is capped in
bytes (excess is counted and dropped; the SDK asks again with backoff).

Who asks cannot be known: an MQTT 3.1.1/5 subscriber does not learn who published what it
reads, so the broker's ACL on `ROOT/resend` is the control. What an ask can do is bounded
instead: it repeats a held stream on that stream's own reply topic, never where the asker
says, except one `gone` on `model`'s or `reply_to`'s topic for a stream no longer held.

A contract ask (`{id, from_seq}`) names no topic, so for a stream no longer held (a QoS 0
stream, never stored; one past the window) the reply topics of the last `RECENT_STREAMS`
requests are kept in memory: `gone` goes there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.delivery.outbox import OutMessage
from agent.delivery.spool import Spool
from agent.delivery.spool_items import SpooledMessage
from agent.protocol.errors import ID_PATTERN, WireError
from agent.protocol.payload import encode_payload
from agent.protocol.replies import gone_message
from agent.protocol.topics import BAD_LEVELS, ReplyTopics

MAX_SEQS = 1000  # seqs one resend request may list
REPEAT_S = 1.0  # the same resend request again within this time is ignored
MAX_SEQ = 2**63 - 1  # SQLite's INTEGER: a larger seq would raise OverflowError in a query
RECENT_STREAMS = 10_000  # reply topics kept for `gone` (about 2.5 MB at most)


@dataclass(frozen=True)
class ResendRequest:
    id: str
    from_seq: int | None
    seqs: tuple[int, ...] | None
    topic: str | None  # where to say `gone` when the stream is not held


class TokenBucket:
    """`rate` tokens a second, up to `burst`; thread-safe."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        """Under the lock: the tokens earned since the last look."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def take(self, n: float = 1.0) -> bool:
        with self._lock:
            self._refill()
            if self._tokens < n:
                return False
            self._tokens -= n
            return True

    def take_or_owe(self, n: float) -> bool:
        """Take `n` tokens when there are as many (or the bucket is full: a message larger
        than the burst goes then, and the debt keeps the average rate)."""
        with self._lock:
            self._refill()
            if self._tokens < min(n, self.burst):
                return False
            self._tokens -= n
            return True

    def give(self, n: float) -> None:
        """Return tokens taken and not used."""
        with self._lock:
            self._tokens = min(self.burst, self._tokens + n)

    def take_up_to(self, n: int) -> int:
        """As many whole tokens as there are, at most `n` (0: none)."""
        with self._lock:
            self._refill()
            granted = min(n, int(self._tokens))
            self._tokens -= granted
            return granted


def _uint(value: Any) -> bool:
    """An unsigned integer SQLite can hold (larger ones raise OverflowError in a query)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEQ


def parse_resend(
    payload: Mapping[str, Any], *, root: str, reply_topics: ReplyTopics
) -> ResendRequest:
    """Validate `{id, from_seq}` or `{id, seqs: [..]}` (plus optional `model`/`reply_to`,
    which say where `gone` goes for a stream the agent no longer holds)."""
    unknown = set(payload) - {"id", "from_seq", "seqs", "model", "reply_to"}
    if unknown:
        raise WireError("bad_request", f"unknown key(s) in resend: {sorted(unknown)}")
    request_id = payload.get("id")
    if not isinstance(request_id, str) or not ID_PATTERN.fullmatch(request_id):
        raise WireError("bad_request", "resend needs a valid id")
    from_seq, seqs = payload.get("from_seq"), payload.get("seqs")
    if (from_seq is None) == (seqs is None):
        raise WireError("bad_request", "resend needs exactly one of from_seq and seqs")
    if from_seq is not None and not _uint(from_seq):
        raise WireError("bad_request", "from_seq must be an unsigned integer below 2**63")
    if seqs is not None and (
        not isinstance(seqs, list | tuple)
        or not 1 <= len(seqs) <= MAX_SEQS
        or not all(_uint(s) for s in seqs)
    ):
        raise WireError(
            "bad_request", f"seqs must be 1 to {MAX_SEQS} unsigned integers below 2**63"
        )
    topic = None
    reply_to, model = payload.get("reply_to"), payload.get("model")
    if reply_to is not None:
        problem = reply_topics.problem(reply_to)
        if problem is not None:
            raise WireError("bad_request", problem)
        topic = reply_to
    elif isinstance(model, str) and ID_PATTERN.fullmatch(model) and model not in BAD_LEVELS:
        topic = f"{root}/result/{model}/{request_id}"
    return ResendRequest(
        request_id,
        from_seq,
        tuple(sorted(set(seqs))) if seqs is not None else None,
        topic,
    )


class Resender:
    """Answers resend requests from the spool, within the rate limits."""

    def __init__(
        self,
        spool: Spool,
        send: Callable[[OutMessage], bool],
        make_properties: Callable[[bytes], Any],
        *,
        requests_per_s: float,
        messages_per_s: float,
        gone_qos: int,
        bytes_per_s: float = 4 * 1024 * 1024,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """`defer(answer)`: where the spool is read (the spool writer's thread, after
        everything queued before is on disk); by default at once, on the caller's thread."""
        self._spool = spool
        self._defer = defer or (lambda answer: answer())
        self._send = send
        self._make_properties = make_properties
        self._requests = TokenBucket(requests_per_s, max(1.0, requests_per_s))
        self._messages = TokenBucket(messages_per_s, max(1.0, messages_per_s))
        self._bytes = TokenBucket(bytes_per_s, max(1.0, bytes_per_s))
        self._gone_qos = gone_qos
        self.answered = 0
        self.resent_messages = 0
        self.resent_bytes = 0  # payload bytes queued for resending
        self.gone = 0
        self.limited = 0
        self.unanswerable = 0
        self.repeated = 0
        self._recent: dict[ResendRequest, float] = {}  # ask -> when it was last answered
        self._topics: dict[str, str] = {}  # request id -> reply topic, the latest requests'

    def remember(self, request_id: str, topic: str) -> None:
        """A request was accepted: its reply topic, for a `gone` once its stream is not held
        (the network thread calls this; `_say_gone` only reads)."""
        topics = self._topics
        topics.pop(request_id, None)
        topics[request_id] = topic
        if len(topics) > RECENT_STREAMS:
            del topics[next(iter(topics))]

    def handle(self, request: ResendRequest) -> None:
        """Admit the request (repeats ignored, rate-limited) and have it answered."""
        now = time.monotonic()
        if self._recent.get(request) is not None and now - self._recent[request] < REPEAT_S:
            self.repeated += 1  # the same ask again within a second: already being answered
            return
        if not self._requests.take():
            self.limited += 1
            return
        if len(self._recent) > 10_000:
            self._recent = {k: t for k, t in self._recent.items() if now - t < REPEAT_S}
        self._recent[request] = now
        self._defer(lambda: self._answer(request))

    def _answer(self, request: ResendRequest) -> None:
        index = self._spool.held_index(request.id, request.seqs, request.from_seq)
        if not index:
            if self._spool.holds(request.id):
                return  # held, but not those seqs (not sent yet): nothing to resend
            self._say_gone(request)
            return
        # What the buckets allow now, in order: the subscriber asks again for the rest. All or
        # nothing would never answer a stream longer than a bucket's burst.
        allowed = self._messages.take_up_to(len(index))
        chosen = self._within_bytes(index[:allowed])
        self._messages.give(allowed - len(chosen))
        if not chosen:
            self.limited += 1
            return
        self.answered += 1
        loaded = self._spool.load(chosen)
        for n, message in enumerate(loaded):
            if not self._send(self._to_out(message)):
                # The outbox's resend lane is full: the rest is not queued.
                self._bytes.give(sum(len(m.payload) for m in loaded[n:]))
                return
            self.resent_messages += 1
            self.resent_bytes += len(message.payload)

    def _within_bytes(self, index: list[tuple[int, int]]) -> list[int]:
        """The ids of the first messages of `index` the byte bucket allows."""
        chosen = []
        for row_id, size in index:
            if not self._bytes.take_or_owe(size):
                break
            chosen.append(row_id)
        return chosen

    def _to_out(self, message: SpooledMessage) -> OutMessage:
        properties = (
            self._make_properties(message.correlation) if message.correlation is not None else None
        )
        # Volatile: it is already stored; a lost resend is asked for again by the subscriber.
        # `copy_of`: a copy of a suspect of lost connections is judged as the stored message.
        return OutMessage(
            message.topic, message.payload, message.qos, False, properties, copy_of=message.id
        )

    def _say_gone(self, request: ResendRequest) -> None:
        topic = request.topic or self._topics.get(request.id)
        if topic is None:
            self.unanswerable += 1  # not held, not recent, no model/reply_to to say `gone` on
            return
        self.gone += 1
        self._send(OutMessage(topic, encode_payload(gone_message(request.id)), self._gone_qos))
