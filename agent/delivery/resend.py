"""Application-level resend: `ROOT/resend` asks for messages of a recent stream again.

MQTT's QoS is hop by hop: a broker that crashes after acknowledging, or a subscriber that was
away without a persistent session, loses messages no client-side spool can bring back. The
spool keeps every QoS 1/2 message for the resend window (bounded by age and bytes) after the
broker acknowledged it; this module answers resend requests from it, byte for byte, on the
stream's reply topic, or with one `gone` message when the stream is no longer held.

Resend requests are outside input: size-limited, validated, and rate-limited by a token
bucket so that a flood of them cannot starve live streams (excess requests are counted and
dropped; the SDK asks again with backoff).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.delivery.outbox import OutMessage
from agent.delivery.spool import Spool
from agent.delivery.spool_items import SpooledMessage
from agent.protocol.errors import ID_PATTERN, WireError
from agent.protocol.payload import encode_payload
from agent.protocol.replies import gone_message

MAX_SEQS = 1000  # seqs one resend request may list
REPEAT_S = 1.0  # the same resend request again within this time is ignored


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

    def take_up_to(self, n: int) -> int:
        """As many whole tokens as there are, at most `n` (0: none)."""
        with self._lock:
            self._refill()
            granted = min(n, int(self._tokens))
            self._tokens -= granted
            return granted


def _uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_resend(
    payload: Mapping[str, Any], *, root: str, allowed_prefixes: Sequence[str]
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
        raise WireError("bad_request", "from_seq must be an unsigned integer")
    if seqs is not None and (
        not isinstance(seqs, list | tuple)
        or not 1 <= len(seqs) <= MAX_SEQS
        or not all(_uint(s) for s in seqs)
    ):
        raise WireError("bad_request", f"seqs must be 1 to {MAX_SEQS} unsigned integers")
    topic = None
    reply_to, model = payload.get("reply_to"), payload.get("model")
    if isinstance(reply_to, str):
        if not any(reply_to.startswith(p) for p in allowed_prefixes) or any(
            c in reply_to for c in "+#\0"
        ):
            raise WireError("bad_request", "reply_to is not an allowed topic")
        topic = reply_to
    elif isinstance(model, str) and ID_PATTERN.fullmatch(model):
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
        self._gone_qos = gone_qos
        self.answered = 0
        self.resent_messages = 0
        self.gone = 0
        self.limited = 0
        self.unanswerable = 0
        self.repeated = 0
        self._recent: dict[ResendRequest, float] = {}  # ask -> when it was last answered

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
        held = self._spool.held(request.id, request.seqs, request.from_seq)
        if not held:
            if self._spool.holds(request.id):
                return  # held, but not those seqs (not sent yet): nothing to resend
            self._say_gone(request)
            return
        # What the message bucket allows now, in order: the subscriber asks again for the rest.
        # All or nothing would never answer a stream longer than the bucket's burst.
        allowed = self._messages.take_up_to(len(held))
        if not allowed:
            self.limited += 1
            return
        self.answered += 1
        for message in held[:allowed]:
            if self._send(self._to_out(message)):
                self.resent_messages += 1

    def _to_out(self, message: SpooledMessage) -> OutMessage:
        properties = (
            self._make_properties(message.correlation) if message.correlation is not None else None
        )
        # Volatile: it is already stored; a lost resend is asked for again by the subscriber.
        return OutMessage(message.topic, message.payload, message.qos, False, properties)

    def _say_gone(self, request: ResendRequest) -> None:
        if request.topic is None:
            self.unanswerable += 1  # neither held nor a model/reply_to to say `gone` on
            return
        self.gone += 1
        self._send(
            OutMessage(request.topic, encode_payload(gone_message(request.id)), self._gone_qos)
        )
