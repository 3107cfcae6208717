"""`OutMessage`: one MQTT publish, fully encoded, as it goes through the outbox (see
`agent.delivery.outbox`, which exports it too)."""

from __future__ import annotations

from typing import Any


class OutMessage:
    """One MQTT publish, fully encoded; `properties` is a paho `Properties` (MQTT 5) or None.

    `stream` names the stream a QoS 1/2 message belongs to (spooled when set); `finishes` is
    the key of the stored request this message answers for the last time; `spool_id` is set
    when the message is queued for the spool; `copy_of` is the spool id of the stored message
    a resend copies (`stored_id`: either). A plain class with slots: one is made per chunk.
    """

    __slots__ = (
        "copy_of",
        "correlation",
        "finishes",
        "payload",
        "properties",
        "qos",
        "retain",
        "rid",
        "seq",
        "spool_id",
        "stream",
        "topic",
    )

    def __init__(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool = False,
        properties: Any = None,
        stream: str | None = None,
        finishes: str | None = None,
        spool_id: int | None = None,
        correlation: bytes | None = None,
        rid: str | None = None,  # the reply stream's id and seq, for application-level resend
        seq: int | None = None,
        copy_of: int | None = None,
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties = properties
        self.stream = stream
        self.finishes = finishes
        self.spool_id = spool_id
        self.correlation = correlation
        self.rid = rid
        self.seq = seq
        self.copy_of = copy_of

    @property
    def stored_id(self) -> int | None:
        """The spool id of the stored message this is, or copies."""
        return self.spool_id if self.spool_id is not None else self.copy_of

    def __repr__(self) -> str:
        return (
            f"OutMessage({self.topic!r}, {len(self.payload)} bytes, qos={self.qos}, "
            f"spool_id={self.spool_id})"
        )
