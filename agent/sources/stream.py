"""A source's stream: the reply envelope's chunk messages, one or more a frame, numbered by a
`seq` that is reserved on disk (SeqStore) before it is used, its parts sized by the broker's
packet limit as it is at each frame (`agent.delivery.packet_limit`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.delivery.packet_limit import PacketLimit
from agent.inference.reply_stream import PART_OVERHEAD, ReplyStream, encode_with_outputs
from agent.models.backends.base import Array
from agent.protocol.payload import encode_payload
from agent.protocol.replies import split_parts
from agent.protocol.tensors import encode_outputs
from agent.sources.seq import SeqStore


class SourceStream(ReplyStream):
    """The endless stream of one source: chunk messages only, seq kept by a SeqStore."""

    seqs: SeqStore | None = None
    packet_limit: PacketLimit | None = None  # the broker's, shared (set by the agent)
    _sized: tuple[int, int] = (0, 0)  # (the packet limit, the payload bound it gave)

    def frame(self, outputs: Mapping[str, Array], index: int, extra: dict[str, Any]) -> int:
        """Queue the result of one frame; the number of messages it took (parts)."""
        outputs_cbor = encode_outputs(outputs)
        bound = self._chunk_bound()
        if len(outputs_cbor) + PART_OVERHEAD <= bound:
            self._reserve(1)
            self._emit(
                encode_with_outputs(self._fields("chunk", index=index, **extra), outputs_cbor)
            )
            self.chunks += 1
            return 1
        pieces = split_parts(outputs_cbor, bound - PART_OVERHEAD)
        self._reserve(len(pieces))
        for k, data in enumerate(pieces):
            fields = self._fields("chunk", index=index, part=[k, len(pieces)], data=data, **extra)
            self._emit(encode_payload(fields))
            self.chunks += 1
        return len(pieces)

    def _chunk_bound(self) -> int:
        """`max_chunk_bytes`, or less where the broker's packet limit (read once a frame, one
        int) leaves less room; worked out again only when that limit changed."""
        limit = self.packet_limit
        if limit is None:
            return self.max_chunk_bytes
        current = limit.bytes
        sized = self._sized
        if sized[0] != current:
            bound = limit.chunk_bytes(self.max_chunk_bytes, self.topic, self.qos, self.correlation)
            sized = self._sized = (current, bound)
        return sized[1]

    def _reserve(self, count: int) -> None:
        if self.seqs is not None:
            self.seqs.ensure(self.seq + count)
