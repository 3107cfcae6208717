"""A flood of resend asks for large messages is bounded in bytes: on the wire by the bytes
bucket, in memory by the outbox's resend lane; integers SQLite cannot hold are refused."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

from agent.client import AgentClient
from agent.delivery.resend import parse_resend
from agent.delivery.spool import Spool
from agent.protocol.errors import WireError
from agent.protocol.payload import encode_payload
from agent.protocol.topics import ReplyTopics
from agent.service.agent import Agent
from tests.conftest import agent_config

MESSAGE_BYTES = 256 * 1024
MESSAGES = 20
BYTES_PER_S = 1024 * 1024
ASKS = 3000


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _held_stream(path: Path, topic: str, rid: str) -> None:
    """A finished stream of large messages, acknowledged: the resend history."""
    spool = Spool(path, max_bytes=1 << 28, max_messages=100_000)
    try:
        ids = [
            spool.add(f"decoder/{rid}", topic, bytes([seq]) * MESSAGE_BYTES, 1, False, None,
                      rid=rid, seq=seq)[0]
            for seq in range(MESSAGES)
        ]  # fmt: skip
        spool.ack(ids)
    finally:
        spool.close()


def test_resend_integers_beyond_sqlite_are_bad_requests():
    for payload in ({"id": "r", "from_seq": 2**63}, {"id": "r", "seqs": [1, 2**63]}):
        try:
            parse_resend(payload, root="edge/d", reply_topics=ReplyTopics(("edge/",)))
        except WireError as e:
            assert e.code == "bad_request" and "2**63" in e.message
        else:
            raise AssertionError(f"{payload} was accepted")
    largest = parse_resend(
        {"id": "r", "from_seq": 2**63 - 1}, root="e", reply_topics=ReplyTopics(())
    )
    assert largest.from_seq == 2**63 - 1


def test_a_resend_flood_is_bounded_in_bytes_and_memory(broker, repository, tmp_path):
    config = agent_config(
        tmp_path,
        broker,
        repository,
        RESEND__REQUESTS_PER_S="100000",
        RESEND__MESSAGES_PER_S="100000",
        RESEND__BYTES_PER_S=str(BYTES_PER_S),
    )
    assert config.spool.path is not None
    rid = "flood-1"
    topic = f"{config.root_topic}/result/decoder/{rid}"
    _held_stream(config.spool.path, topic, rid)
    agent = Agent(config)
    agent.start()
    client = AgentClient(broker.host, broker.port, device_id=config.device_id).connect()
    try:
        assert agent.wait_ready(10)
        received: list[tuple[float, int]] = []
        lock = threading.Lock()

        def got(t: str, m: Any, raw: bytes) -> None:
            with lock:
                received.append((time.monotonic(), len(raw)))

        client.listen(topic, got)
        events: queue.Queue[dict[str, Any]] = queue.Queue()
        client.listen(f"{config.root_topic}/events", lambda t, m, raw: events.put(m or {}))
        time.sleep(0.3)
        rss_before = _rss_bytes()
        peak = [rss_before]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.05):
                peak[0] = max(peak[0], _rss_bytes())

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        for i in range(ASKS):  # every ask distinct: none is a repeat the filter drops
            ask = {"id": rid, "seqs": [i % MESSAGES, 1000 + i]}
            client.publish_raw(f"{config.root_topic}/resend", encode_payload(ask))
        time.sleep(3.0)
        elapsed = time.monotonic() - started
        with lock:
            sent = sum(size for at, size in received if at - started <= elapsed)
        sampling.set()
        sampler.join()
        # Without the bytes bucket: 3000 x 256 KiB. With it: a burst and the rate, plus the
        # one message a full bucket lets through.
        assert 0 < sent <= BYTES_PER_S * (elapsed + 1) + 2 * MESSAGE_BYTES, (sent, elapsed)
        assert peak[0] - rss_before < 150 * 1024 * 1024, (rss_before, peak[0])
        assert agent.resender is not None and agent.resender.limited > 0

        # An integer SQLite cannot hold: a bad request (it once raised in the spool writer).
        client.publish_raw(
            f"{config.root_topic}/resend", encode_payload({"id": rid, "from_seq": 2**63})
        )
        deadline = time.monotonic() + 10
        while True:
            event = events.get(timeout=max(0.1, deadline - time.monotonic()))
            if event.get("type") == "bad_request" and "2**63" in event.get("reason", ""):
                break
        # A normal ask is still answered, once the bucket has refilled.
        time.sleep(1.5)
        with lock:
            before = len(received)
        client.publish_raw(
            f"{config.root_topic}/resend", encode_payload({"id": rid, "seqs": [MESSAGES - 1]})
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with lock:
                if any(size == MESSAGE_BYTES for _, size in received[before:]):
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("a normal resend after the flood was not answered")
        assert agent.transport.reconnects == 0
    finally:
        client.close()
        agent.stop()
