"""A flood of malformed requests: one error each where the id is readable, counted otherwise."""

from __future__ import annotations

import os
import queue
import random
import time

import cbor2
import numpy as np

from agent.client import REPLY_LIMITS
from agent.protocol.errors import ERROR_CODES
from agent.protocol.payload import encode_payload


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor(shape: list[int], tag: int, data: bytes) -> cbor2.CBORTag:
    return cbor2.CBORTag(40, [shape, cbor2.CBORTag(tag, data)])


def malformed_payloads(rng: random.Random) -> list[tuple[bytes, str | None]]:
    """400 bad requests as (payload, id the agent can read or None)."""
    good_token = _tensor([1, 1], 79, np.array([[1]], dtype="<i8").tobytes())
    cases: list[tuple[bytes, str | None]] = []

    def add(body: object, readable: str | None) -> None:
        cases.append((cbor2.dumps(body), readable))

    for _ in range(40):  # random bytes (never starting with a CBOR map header)
        cases.append((bytes([0xFF]) + rng.randbytes(rng.randint(0, 300)), None))
    for _ in range(30):  # CBOR that is not a map
        add(rng.choice([[1, 2, 3], "text", 42, b"bytes", None, 3.5]), None)
    for i in range(30):  # wrong dtype: float32 where int64 is declared
        add({"id": f"dtype-{i}", "inputs": {"token": _tensor([1, 1], 85, b"\0" * 4)}}, f"dtype-{i}")
    for i in range(30):  # wrong rank / fixed dim
        add(
            {"id": f"shape-{i}", "inputs": {"token": _tensor([1, 2], 79, b"\0" * 16)}}, f"shape-{i}"
        )
    for i in range(30):  # shapes that lie about their byte length
        add({"id": f"lie-{i}", "inputs": {"token": _tensor([1, 3], 79, b"\0" * 8)}}, f"lie-{i}")
    for i in range(30):  # 2^40 elements
        add(
            {"id": f"huge-{i}", "inputs": {"token": _tensor([1 << 20, 1 << 20], 79, b"\0" * 8)}},
            f"huge-{i}",
        )
    for i in range(30):  # deep nesting
        deep: object = 1
        for _ in range(100):
            deep = [deep]
        # The id comes first, so the agent can still read it without decoding the rest.
        add(
            {"id": f"deep-{i}", "inputs": {"token": good_token}, "params": {"x": deep}}, f"deep-{i}"
        )
    for _ in range(30):  # bad ids
        bad = rng.choice(["", "x" * 65, "has space", "new\nline", 17, None, "slash/id", "plus+"])
        add({"id": bad, "inputs": {"token": good_token}}, None)
    for i in range(30):  # reply_to outside the allowed prefixes, with wildcards or controls
        target = rng.choice(
            ["other/topic", "edge/#", "edge/+/x", "/abs", "", "edge/x\x01y", "edge/../x"]
        )
        add({"id": f"reply-{i}", "inputs": {"token": good_token}, "reply_to": target}, f"reply-{i}")
    for i in range(30):  # bad priority
        add(
            {
                "id": f"prio-{i}",
                "inputs": {"token": good_token},
                "priority": rng.choice([10, -1, True, "4", 4.5]),
            },
            f"prio-{i}",
        )
    for i in range(30):  # unknown keys, wrong types of known keys
        body = rng.choice(
            [
                {"id": f"kind-{i}", "inputs": {"token": good_token}, "unexpected": 1},
                {"id": f"kind-{i}", "inputs": [good_token]},
                {"id": f"kind-{i}", "inputs": {"token": good_token}, "stream": "yes"},
                {"id": f"kind-{i}", "inputs": {"token": good_token}, "qos": 3},
                {"id": f"kind-{i}", "inputs": {"token": good_token}, "deadline_ms": -5},
            ]
        )
        add(body, f"kind-{i}")
    for i in range(30):  # too many keys in the inputs map
        add({"id": f"keys-{i}", "inputs": {f"k{j}": good_token for j in range(100)}}, f"keys-{i}")
    for i in range(20):  # truncated CBOR whose id comes first: still answered
        data = cbor2.dumps({"id": f"trunc-{i}", "inputs": {"token": good_token}})
        cases.append((data[:-3], f"trunc-{i}"))
    for i in range(10):  # truncated CBOR whose id comes last: only counted
        data = cbor2.dumps({"inputs": {"token": good_token}, "id": f"late-{i}"})
        cases.append((data[:-3], None))
    assert len(cases) == 400
    return cases


def test_four_hundred_malformed_requests(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    replies: queue.Queue[dict] = queue.Queue()
    events: queue.Queue[dict] = queue.Queue()
    cases = malformed_payloads(random.Random(7))
    # Warm up once so the memory baseline includes everything a first request allocates.
    list(client.request("decoder", {"token": np.array([[1]], dtype=np.int64)}))
    client.listen(f"{agent.root}/result/#", lambda t, m, raw: replies.put(m))
    client.listen(f"{agent.root}/events", lambda t, m, raw: events.put(m))
    before = _rss_bytes()
    for payload, _ in cases:
        client.publish_raw(f"{agent.root}/infer/decoder", payload, qos=1)

    readable = {rid for _, rid in cases if rid is not None}
    got: dict[str, dict] = {}
    deadline = time.monotonic() + 15
    while len(got) < len(readable) and time.monotonic() < deadline:
        try:
            message = replies.get(timeout=0.1)
        except queue.Empty:
            continue
        assert message["id"] not in got, f"two replies for {message['id']}"
        got[message["id"]] = message
    assert set(got) == readable
    for rid, message in got.items():
        assert message["type"] == "error" and message["seq"] == 0
        assert message["code"] in ERROR_CODES
        expected = "too_large" if rid.startswith("huge-") else "bad_request"
        assert message["code"] == expected, (rid, message)
        assert message["message"]

    # The rest are counted on the events topic (aggregated, never one event per message).
    unreadable = len(cases) - len(readable)
    counted = 0
    deadline = time.monotonic() + 5
    while counted < unreadable and time.monotonic() < deadline:
        try:
            event = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if event["type"] == "bad_request":
            counted += event["count"]
            assert event["reason"]
    assert counted == unreadable
    assert agent.counters["requests_received"] >= 401

    time.sleep(0.2)
    assert replies.empty(), "a request got more than one reply"

    # Still up, memory flat, and a valid request succeeds.
    reply = client.request("decoder", {"token": np.array([[1]], dtype=np.int64)})
    assert len(list(reply)) == 32
    growth = _rss_bytes() - before
    assert growth < 16 * 1024 * 1024, f"memory grew by {growth / 1e6:.1f} MB"


def test_oversized_payload_is_refused_before_decoding(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository, LIMITS__MAX_PAYLOAD_BYTES="4096")
    client = make_client(broker, agent)
    tokens = np.ones((1, 4000), dtype=np.int64)
    reply = client.request("decoder", {"token": tokens}, timeout=5)
    try:
        list(reply)
    except Exception as e:
        assert getattr(e, "code", None) == "too_large"
    else:
        raise AssertionError("an oversized request was accepted")
    assert REPLY_LIMITS.max_payload_bytes > 4096


def test_model_levels_no_model_has_get_no_reply_on_a_topic_with_such_a_level(
    broker, repository, make_agent, make_client
):
    """`ROOT/infer/..` (or `.`, or empty) names no model, and a reply topic has no such level:
    the request is counted, not answered; a resend naming such a model is not answered."""
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    replies: queue.Queue[str] = queue.Queue()
    client.listen(f"{agent.root}/result/#", lambda t, m, raw: replies.put(t))
    body = encode_payload({"id": "status", "inputs": {"token": np.array([[1]], dtype=np.int64)}})
    for level in ("..", ".", ""):
        client.publish_raw(f"{agent.root}/infer/{level}", body, qos=1)
    resend = encode_payload({"id": "status", "from_seq": 0, "model": ".."})
    client.publish_raw(f"{agent.root}/resend", resend, qos=1)
    deadline = time.monotonic() + 5
    while agent.counters["rejected_unknown_model"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.counters["rejected_unknown_model"] == 3
    assert len(list(client.request("decoder", {"token": np.array([[1]], dtype=np.int64)}))) == 32
    time.sleep(0.3)
    topics = [replies.get_nowait() for _ in range(replies.qsize())]
    assert topics and all("/result/decoder/" in t for t in topics)  # the good request's
