"""Reply streams and sources sized by the broker's packet limit.

The agent has one :class:`PacketLimit` (`agent.delivery.packet_limit`): made from `[mqtt]`
by the request reader (`agent.service.ingress.RequestReader.packet_limit`), set by the
transport at every CONNACK, read by every stream. A request's reply stream reads it once, when
it is made; a local source's stream once a frame (`share_packet_limit`). A stream that
outlives a smaller limit (a reconnect to a stricter broker) may still make a message too
large: the window quarantines it and ends the stream (`agent.mqtt.oversize`).
"""

from __future__ import annotations

from agent.delivery.packet_limit import PacketLimit
from agent.sources import SourceManager


def share_packet_limit(limit: PacketLimit, sources: SourceManager) -> None:
    """Every local source's stream sizes its frames by `limit` (read once a frame)."""
    for runner in sources.runners:
        runner.stream.packet_limit = limit
