"""Reply messages of the contract: the envelope every reply carries, the ``gone`` message of
a resend, and a reply's outputs split into parts and (for clients) reassembled.

The outputs themselves are encoded by `agent.protocol.tensors` (:func:`encode_outputs`,
:func:`outputs_pieces`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from agent.protocol.errors import PROTOCOL_VERSION, Limits
from agent.protocol.payload import decode_payload
from agent.protocol.values import decode_value

__all__ = ["gone_message", "reassemble_parts", "reply_envelope", "split_parts"]


def reply_envelope(
    *, request_id: str, seq: int | None, type: str, model: str, version: int, **extra: Any
) -> dict[str, Any]:
    """The fields every reply message carries, stamped with the emit time (Unix ns)."""
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "seq": seq,
        "type": type,
        "model": model,
        "version": version,
        "ts": time.time_ns(),
        **extra,
    }


def gone_message(request_id: str) -> dict[str, Any]:
    """The one message a resend of a stream no longer held gets."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "gone", "seq": None}


def split_parts(outputs_cbor: bytes, max_data_bytes: int) -> list[bytes]:
    """Contiguous slices of at most ``max_data_bytes``; joined in order they give the input."""
    if max_data_bytes < 1:
        raise ValueError(f"max_data_bytes must be positive, got {max_data_bytes}")
    if len(outputs_cbor) <= max_data_bytes:
        return [bytes(outputs_cbor)]
    return [
        outputs_cbor[i : i + max_data_bytes] for i in range(0, len(outputs_cbor), max_data_bytes)
    ]


# The joined parts are already in memory; the other limits still bound what they decode to.
_PARTS_LIMITS = Limits(max_payload_bytes=1 << 62)


def reassemble_parts(parts: Sequence[bytes], *, limits: Limits | None = None) -> dict[str, Any]:
    """The inverse of :func:`split_parts` + :func:`agent.protocol.tensors.encode_outputs`, for
    clients.

    Decodes with the default limits (tensor sizes, depth, keys) but no payload size limit,
    unless ``limits`` says otherwise. Raises :class:`agent.protocol.errors.WireError` on
    malformed data.
    """
    limits = limits or _PARTS_LIMITS
    outputs = decode_payload(b"".join(parts), limits)
    return {name: decode_value(value, limits, name=name) for name, value in outputs.items()}
