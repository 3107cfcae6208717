"""The broker's packet limit, shared: what the connection learns, what producers size by.

A broker drops the connection of a client that publishes a packet larger than its limit
(Mosquitto: "oversize packet"); a QoS 0 message is then simply gone. MQTT 5 brokers announce
the limit in CONNACK (Maximum Packet Size); 3.1.1 brokers cannot, so `[mqtt]
max_packet_bytes` states it. One :class:`PacketLimit` per agent: the transport sets it at
every CONNACK (it may shrink on a reconnect), reply streams and sources read `bytes`, a plain
int, once a stream or once a frame, and size their parts by it (`chunk_bytes`). The window
checks every message against it just before publishing (`publish_size`).
"""

from __future__ import annotations

MQTT_MAX_REMAINING = 268_435_455  # the protocol's own bound on a packet's remaining length
NO_LIMIT = 1 + 4 + MQTT_MAX_REMAINING  # the largest packet MQTT can express at all
MIN_CHUNK_BYTES = 1024  # a stream's parts never go below this (`[limits] max_chunk_bytes`' floor)
_FIXED_HEADER_MAX = 5  # the command byte and up to 4 bytes of remaining length


def varint_size(value: int) -> int:
    """Bytes of MQTT's variable byte integer for `value`."""
    if value < 128:
        return 1
    if value < 16_384:
        return 2
    return 3 if value < 2_097_152 else 4


def properties_size(correlation: bytes | None) -> int:
    """Bytes of a PUBLISH's MQTT 5 property field carrying at most the correlation data (the
    only property the agent publishes): its length, then id, 2-byte length and the data."""
    inner = 0 if correlation is None else 3 + len(correlation)
    return varint_size(inner) + inner


def publish_size(topic_bytes: int, qos: int, properties_bytes: int, payload_bytes: int) -> int:
    """Bytes of a whole PUBLISH packet: fixed header, topic (2-byte length and UTF-8),
    packet id (QoS 1/2), the property field (0 on MQTT 3.1.1: none) and the payload."""
    remaining = 2 + topic_bytes + (2 if qos else 0) + properties_bytes + payload_bytes
    return 1 + varint_size(remaining) + remaining


class PacketLimit:
    """The largest packet the broker takes now: min(configured, announced); `NO_LIMIT` when
    neither says. Written by the transport under its io lock, read anywhere (one int)."""

    __slots__ = ("announced", "bytes", "configured", "mqtt5")

    def __init__(self, configured: int = 0, *, mqtt5: bool = True) -> None:
        """`configured`: `[mqtt] max_packet_bytes` (0: no limit of ours)."""
        self.configured = configured
        self.mqtt5 = mqtt5
        self.announced: int | None = None
        self.bytes = configured or NO_LIMIT

    @property
    def limited(self) -> bool:
        """Whether any limit below the protocol's own applies."""
        return self.bytes < NO_LIMIT

    def announce(self, announced: int | None) -> int:
        """The broker's Maximum Packet Size of this connection (None: it announced none, or
        MQTT 3.1.1); returns the limit now in force."""
        self.announced = announced or None
        limits = [n for n in (self.configured, self.announced) if n]
        self.bytes = min(limits) if limits else NO_LIMIT
        return self.bytes

    def overhead(self, topic: str, qos: int, correlation: bytes | None) -> int:
        """A PUBLISH's bytes besides its payload, at most (the fixed header at its largest)."""
        properties = properties_size(correlation) if self.mqtt5 else 0
        return _FIXED_HEADER_MAX + 2 + len(topic.encode()) + (2 if qos else 0) + properties

    def chunk_bytes(
        self, max_chunk_bytes: int, topic: str, qos: int, correlation: bytes | None
    ) -> int:
        """The payload bound of a stream's messages on `topic`: `max_chunk_bytes`, or less
        where the broker's packet limit leaves less room (never below `MIN_CHUNK_BYTES`: a
        message still too large is the window's to quarantine)."""
        if not self.limited:
            return max_chunk_bytes
        room = self.bytes - self.overhead(topic, qos, correlation)
        return max(MIN_CHUNK_BYTES, min(max_chunk_bytes, room))
