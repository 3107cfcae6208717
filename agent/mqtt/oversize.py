"""Messages too large for the broker's packet limit: never published, the stream ended.

Reply streams and sources size their parts by the broker's limit (`agent.delivery.
packet_limit`), yet a message can still be too large: a status or inventory payload, a part
made before the limit shrank on a reconnect, a spooled message read back after a restart
against a stricter broker. Published, it would cost the connection (Mosquitto drops the
client: "oversize packet"), and a spooled one would do so again after every reconnect. So
the window checks every message's packet size just before publishing it
(:meth:`Oversize.refuses`): one that does not fit is quarantined (`agent.mqtt.poison`:
forgotten by the spool, counted, `publish_refused`), and where it was a request's `chunk` or
`result`, an `error` (`too_large`) takes its place and number, so the subscriber learns the
stream ended instead of waiting for it; the stream's later messages are dropped
(:meth:`Oversize.drops`), so that error stays its one terminal message. Used by the holder of
the transport's io lock only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import cbor2

from agent.delivery.out_message import OutMessage
from agent.delivery.packet_limit import NO_LIMIT, PacketLimit, properties_size, publish_size
from agent.mqtt.poison import Quarantine
from agent.protocol.payload import encode_payload
from agent.protocol.replies import reply_envelope

log = logging.getLogger(__name__)

# Bytes a PUBLISH adds to its payload, topic and correlation data, at most: fixed header (5),
# topic length (2), packet id (2), property length (4) and the correlation's id and length (3).
_SLACK = 16
ENDED_REMEMBERED = 1024  # streams already ended here (one error each), then forgotten


def packet_bytes(message: OutMessage, qos: int, mqtt5: bool) -> int:
    """The size of `message`'s PUBLISH packet at `qos`."""
    properties = 0
    if mqtt5:
        if message.properties is None or message.correlation is not None:
            correlation = message.correlation if message.properties is not None else None
            properties = properties_size(correlation)
        else:  # properties other than the correlation data: as paho packs them
            properties = len(message.properties.pack())
    return publish_size(len(message.topic.encode()), qos, properties, len(message.payload))


class Oversize:
    """The packet-size check of the window; `put(message)` queues an error without waiting."""

    def __init__(
        self, limit: PacketLimit, quarantine: Quarantine, put: Callable[[OutMessage], bool]
    ) -> None:
        self.limit = limit
        self._quarantine = quarantine
        self._put = put
        self.count = 0  # messages refused as too large
        # (topic, id) of the streams ended here -> the error that ended each. Read directly by
        # the window (empty but after a too large reply); changed in place, never replaced.
        self.ended: dict[tuple[str, str], OutMessage] = {}

    def refuses(self, message: OutMessage, qos: int) -> bool:
        """Whether `message` is too large to publish at `qos` (then it is quarantined here
        and its stream ended). Without a limit, or far below it, a few additions."""
        limit = self.limit.bytes
        if limit >= NO_LIMIT:
            return False
        correlation = message.correlation
        rough = len(message.payload) + 4 * len(message.topic) + _SLACK
        if rough + (len(correlation) if correlation is not None else 0) <= limit:
            return False
        size = packet_bytes(message, qos, self.limit.mqtt5)
        if size <= limit:
            return False
        self.count += 1
        self._quarantine.quarantine(message, f"too large for the broker ({size} > {limit} bytes)")
        self._end_stream(message, size, limit)
        return True

    def drops(self, message: OutMessage) -> bool:
        """Whether `message` comes after the `too_large` error that ended its stream (a part,
        or the `end`, of a request still running): then it is quarantined, never published."""
        if message.rid is None:
            return False
        key = (message.topic, message.rid)
        error = self.ended.get(key)
        if error is None or error is message:
            return False
        self._quarantine.quarantine(message, "its stream was ended by a too large message")
        envelope = _envelope(message.payload)
        if envelope is not None and envelope.get("type") in ("end", "result", "error"):
            del self.ended[key]  # its own terminal: a later request may take the id again
        return True

    def _end_stream(self, message: OutMessage, size: int, limit: int) -> None:
        """A request's `chunk` or `result` lost this way: its stream ends with an `error`
        (`too_large`) in its place, once a stream. Status, inventory, events and the
        endless streams of local sources are only quarantined."""
        if message.rid is None or message.seq is None or _is_source(message):
            return
        key = (message.topic, message.rid)
        if key in self.ended:
            return
        error = too_large_error(message, size, limit)
        if error is None:
            return
        if len(self.ended) >= ENDED_REMEMBERED:
            self.ended.clear()
        self.ended[key] = error
        if not self._put(error):
            log.error("mqtt: no room for the too_large error of %s", message.rid)


def _is_source(message: OutMessage) -> bool:
    return message.stream is not None and message.stream.startswith("source/")


def too_large_error(message: OutMessage, size: int, limit: int) -> OutMessage | None:
    """The `error` (`too_large`) that ends the stream of `message`, a request's `chunk` or
    `result`, with its number; None when its envelope cannot be read or it is no such
    message. Not spooled (it answers what is gone); it finishes the stored request where
    `message` did."""
    envelope = _envelope(message.payload)
    if envelope is None or envelope.get("type") not in ("chunk", "result"):
        return None
    model, version = envelope.get("model"), envelope.get("version")
    if not isinstance(model, str) or not isinstance(version, int):
        return None
    fields = reply_envelope(
        request_id=message.rid or "",
        seq=message.seq,
        type="error",
        model=model,
        version=version,
        code="too_large",
        message=f"a reply message is too large for the broker ({size} > {limit} bytes)",
    )
    return OutMessage(
        message.topic,
        encode_payload(fields),
        message.qos,
        False,
        message.properties,
        finishes=message.finishes,
        correlation=message.correlation,
        rid=message.rid,
        seq=message.seq,
    )


def _envelope(payload: bytes) -> dict[str, Any] | None:
    """A reply payload's map (decoded once, on this rare path), or None."""
    try:
        decoded = cbor2.loads(payload)
    except Exception:
        return None
    return decoded if isinstance(decoded, dict) else None
