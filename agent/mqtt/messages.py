"""What crosses the MQTT wall as plain values: a received message (`Incoming`), the request
properties the fast reader takes out of a PUBLISH (`RequestProperties`, `parse_publish`), the
properties of a reply (`correlation_properties`) and a PUBLISH's packed topic (`topic_field`).

Nothing here touches paho's client: these are read and written from the bytes of the
protocol (MQTT 3.1.1 and 5), which do not change with paho's versions.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

_RESPONSE_TOPIC, _CORRELATION_DATA = 0x08, 0x09


@dataclass
class Incoming:
    """A received message, as the ingress code needs it (paho's object stays inside
    `agent.mqtt`).

    `deferred` is set when the handler took over the acknowledgement of a QoS 1/2 message
    (`Transport.defer`); otherwise the transport acknowledges it as soon as the handler
    returns.
    """

    topic: str
    payload: bytes
    qos: int
    response_topic: str | None = None
    correlation_data: bytes | None = None
    dup: bool = False
    mid: int = 0
    deferred: bool = False
    retain: bool = False  # a retained message the broker held (not a live one)


@dataclass(frozen=True)
class RequestProperties:
    """The MQTT 5 PUBLISH properties a request may carry, as paho's Properties names them."""

    ResponseTopic: str | None = None  # paho's attribute names
    CorrelationData: bytes | None = None


def correlation_properties(correlation: bytes) -> Properties:
    """MQTT 5 PUBLISH properties carrying `correlation` as CorrelationData: what every reply
    to a request that sent correlation data carries (and a spooled reply read back)."""
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    properties.CorrelationData = correlation
    return properties


def parse_publish(
    packet: bytes | bytearray, qos: int, mqtt5: bool = True
) -> tuple[bytes, int, RequestProperties | None, bytes | bytearray] | None:
    """`(topic, mid, properties, payload)` of a PUBLISH body (after the fixed header): MQTT
    3.1.1, or MQTT 5 with at most one response topic and one correlation data as properties;
    None for any other (paho decodes those, and reports what is malformed). An empty topic
    is left to paho too: an error in MQTT 3.1.1, a topic alias in MQTT 5."""
    try:
        end_topic = 2 + ((packet[0] << 8) | packet[1])
        if end_topic > len(packet) or end_topic == 2:
            return None
        topic = bytes(packet[2:end_topic])
        pos, mid = end_topic, 0
        if qos:
            if pos + 2 > len(packet):
                return None
            mid = (packet[pos] << 8) | packet[pos + 1]
            pos += 2
        if not mqtt5:
            return topic, mid, None, packet[pos:]
        length = shift = 0
        for _ in range(4):  # the properties' length: a variable byte integer
            byte = packet[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        else:
            return None
        end = pos + length
        if end > len(packet):
            return None
        if not length:
            return topic, mid, None, packet[end:]
        response_topic: str | None = None
        correlation: bytes | None = None
        while pos < end:
            ident = packet[pos]
            size = (packet[pos + 1] << 8) | packet[pos + 2]
            value = bytes(packet[pos + 3 : pos + 3 + size])
            pos += 3 + size
            if len(value) != size:
                return None
            if ident == _RESPONSE_TOPIC and response_topic is None:
                response_topic = value.decode("utf-8")
                if "\0" in response_topic:
                    return None
            elif ident == _CORRELATION_DATA and correlation is None:
                correlation = value
            else:
                return None
        if pos != end:
            return None
        return topic, mid, RequestProperties(response_topic, correlation), packet[end:]
    except (IndexError, UnicodeDecodeError):
        return None


def topic_field(topic: str) -> bytes:
    """A PUBLISH's topic as its packet carries it (two length bytes, UTF-8), as paho
    packs it; ValueError where paho's `publish` refuses the topic."""
    name = topic.encode("utf-8")
    if not name or b"+" in name or b"#" in name or len(name) > 65535:
        raise ValueError(f"invalid publish topic {topic[:200]!r}")
    return struct.pack("!H", len(name)) + name


class TopicCache(dict[str, bytes]):
    """`topic_field`s of recent topics, bounded: emptied when full (a request's reply topic
    is used by its messages only; a stream's by many in a row)."""

    LIMIT = 1024

    def __setitem__(self, topic: str, field: bytes) -> None:
        if len(self) >= self.LIMIT:
            self.clear()
        super().__setitem__(topic, field)
