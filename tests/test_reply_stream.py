"""Reply streams (agent.inference.reply_stream): the bytes of chunk and result messages, made
around the outputs' encoded pieces, equal the generic encoding; parts; one terminal message;
messages wait in the stream until its driver takes them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from agent.inference.reply_stream import ReplyStream, encode_with_outputs
from agent.protocol.payload import decode_payload
from agent.protocol.replies import reassemble_parts
from agent.protocol.tensors import encode_outputs
from tests.protocol_helpers import LIMITS


def test_a_result_envelope_is_the_generic_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.inference.reply_stream import ReplyStream

    monkeypatch.setattr(time, "time_ns", lambda: 1_234_567_890_123_456_789)
    outputs = {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([300], np.int64)}
    timing = {"queue_ms": 0.25, "infer_ms": 1.5, "total_ms": 2.0}
    payloads = []
    for request_id, version in (("abc", 3), ("x" * 40, 3), ("abc", 70000)):  # cached middle, new
        reply = ReplyStream(
            request_id=request_id, model="m", version=version, topic="t", qos=1,
            max_chunk_bytes=1 << 20,
        )  # fmt: skip
        reply.seq = 30  # a result after chunks: seq takes two bytes
        assert reply.result(outputs, timing)
        sent = reply.drain()
        reply.seq = 30
        generic = encode_with_outputs(
            reply._fields("result", timing=timing), encode_outputs(outputs)
        )
        assert sent[0].payload == generic
        decoded = decode_payload(generic, LIMITS)
        assert (decoded["id"], decoded["version"], decoded["seq"]) == (request_id, version, 30)
        payloads.append(sent[0].payload)
    assert len(set(payloads)) == 3


def test_a_chunk_envelope_is_the_generic_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.inference.reply_stream import ReplyStream

    monkeypatch.setattr(time, "time_ns", lambda: 1_234_567_890_123_456_789)
    reply = ReplyStream(
        request_id="abc", model="m", version=3, topic="t", qos=1,
        max_chunk_bytes=1 << 20,
    )  # fmt: skip
    outputs = {"next_token": np.array([[7]], np.int64), "p": np.ones((2, 3), np.float32)}
    reply.chunk(outputs, 5)
    sent = reply.drain()
    reply.seq = 0
    generic = encode_with_outputs(reply._fields("chunk", index=5), encode_outputs(outputs))
    assert sent[0].payload == generic
    assert decode_payload(generic, LIMITS)["index"] == 5


def test_messages_wait_in_the_stream_until_drained_and_one_terminal_only() -> None:
    reply = ReplyStream(
        request_id="r", model="m", version=1, topic="t", qos=1, max_chunk_bytes=4096
    )
    big = {"y": np.arange(3000, dtype=np.float32)}  # 12 KB of data: parts of under 4 KB
    reply.chunk(big, 0)
    parts = reply.drain()
    assert len(parts) >= 3 and reply.drain() == []
    decoded = [decode_payload(m.payload, LIMITS) for m in parts]
    assert [d["seq"] for d in decoded] == list(range(len(parts)))
    assert {tuple(d["part"])[1] for d in decoded} == {len(parts)}
    whole = reassemble_parts([d["data"] for d in decoded])
    assert np.array_equal(whole["y"], big["y"])
    assert reply.end({"total_ms": 1.0})
    assert not reply.error("model_error", "too late")  # exactly one terminal message
    (end,) = reply.drain()
    assert decode_payload(end.payload, LIMITS)["type"] == "end"
    reply.chunk({"y": np.zeros(3, np.float32)}, 1)  # a run that returns after the end
    reply.chunk(big, 2)
    assert reply.drain() == []  # nothing follows the terminal message
