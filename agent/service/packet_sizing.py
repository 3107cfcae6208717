"""Reply streams and sources sized by the broker's packet limit.

The agent has one :class:`PacketLimit` (`agent.delivery.packet_limit`): made here from
`[mqtt]` with the request reader (:class:`SizedRequestReader`), set by the transport at every
CONNACK, read by every stream. A request's reply stream reads it once, when it is made; a
local source's stream once a frame (`share_packet_limit`). A stream that outlives a smaller
limit (a reconnect to a stricter broker) may still make a message too large: the window
quarantines it and ends the stream (`agent.mqtt.oversize`).
"""

from __future__ import annotations

from agent.config import AgentConfig
from agent.delivery.packet_limit import PacketLimit
from agent.inference.reply_stream import ReplyStream
from agent.models.manager import ModelManager
from agent.service.ingress import RequestReader
from agent.sources import SourceManager


class SizedRequestReader(RequestReader):
    """A :class:`RequestReader` whose reply streams fit the broker's packets; it holds the
    agent's `packet_limit`."""

    def __init__(self, config: AgentConfig, models: ModelManager) -> None:
        super().__init__(config, models)
        mqtt = config.mqtt
        self.packet_limit = PacketLimit(mqtt.max_packet_bytes, mqtt5=mqtt.protocol == "5")

    def reply_stream(
        self,
        request_id: str,
        model: str,
        version: int | None,
        reply_to: str | None,
        qos: int | None,
        correlation: bytes | None,
    ) -> ReplyStream:
        """The stream `RequestReader` makes, its payload bound cut to the packet limit."""
        stream = super().reply_stream(request_id, model, version, reply_to, qos, correlation)
        limit = self.packet_limit
        if limit.limited:
            stream.max_chunk_bytes = limit.chunk_bytes(
                stream.max_chunk_bytes, stream.topic, stream.qos, stream.correlation
            )
        return stream


def share_packet_limit(limit: PacketLimit, sources: SourceManager) -> None:
    """Every local source's stream sizes its frames by `limit` (read once a frame)."""
    for runner in sources.runners:
        runner.stream.packet_limit = limit
