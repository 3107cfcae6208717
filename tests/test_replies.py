"""Replies: the envelope, `gone`, parts split and reassembled, and the hand-built envelopes of
the reply stream against the generic encoding."""

from __future__ import annotations

import time

import numpy as np
import pytest

from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload, encode_payload
from agent.protocol.replies import gone_message, reassemble_parts, reply_envelope, split_parts
from agent.protocol.tensors import encode_outputs
from tests.protocol_helpers import LIMITS

# ----------------------------------------------------------------------------- replies


def test_reply_envelope_and_gone() -> None:
    before = time.time_ns()
    msg = reply_envelope(
        request_id="r-1", seq=3, type="chunk", model="m", version=2, index=0, outputs={}
    )
    assert msg["v"] == 1 and msg["id"] == "r-1" and msg["seq"] == 3 and msg["type"] == "chunk"
    assert msg["model"] == "m" and msg["version"] == 2 and msg["index"] == 0
    assert before <= msg["ts"] <= time.time_ns()
    assert gone_message("r-1") == {"v": 1, "id": "r-1", "type": "gone", "seq": None}
    decoded = decode_payload(encode_payload(gone_message("r-1")), LIMITS)
    assert decoded["seq"] is None


def test_parts_split_and_reassemble() -> None:
    outputs = {
        "logits": np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32),
        "token": np.array([[7]], dtype=np.int64),
        "done": np.array([True]),
    }
    data = encode_outputs(outputs)
    assert decode_payload(data, LIMITS).keys() == outputs.keys()
    for size in (1, 7, 100, len(data) - 1, len(data), len(data) * 2):
        parts = split_parts(data, size)
        assert all(0 < len(p) <= size for p in parts)
        assert len(parts) == -(-len(data) // size)
        assert b"".join(parts) == data
        back = reassemble_parts(parts)
        assert list(back) == list(outputs)
        np.testing.assert_array_equal(back["logits"], outputs["logits"])
        assert back["token"].tolist() == [[7]] and back["done"].tolist() == [1]
    with pytest.raises(ValueError):
        split_parts(data, 0)
    parts = split_parts(data, 100)
    with pytest.raises(WireError):
        reassemble_parts(parts[:-1])
    # Parts are not bound by the payload limit, only by what they decode to.
    big = encode_outputs({"x": np.zeros(2 << 20, dtype=np.float32)})
    assert len(big) > LIMITS.max_payload_bytes
    assert reassemble_parts(split_parts(big, 1 << 20))["x"].shape == (2 << 20,)
    with pytest.raises(WireError):
        reassemble_parts([big], limits=Limits(max_payload_bytes=1 << 40, max_tensor_bytes=1024))
