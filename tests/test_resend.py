"""Application-level resend: recovery from a broker that loses what it acknowledged."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.protocol.payload import encode_payload
from tests.conftest import write_long_decoder


@pytest.mark.slow
def test_sdk_recovers_every_message_across_three_broker_crashes(
    make_agent, tmp_path, record_property
):
    (tmp_path / "broker").mkdir()
    # Persistence on, saved every second: a crash loses up to a second of what it acknowledged.
    broker = EmbeddedBroker(persistence=True, workdir=tmp_path / "broker").start()
    models = write_long_decoder(tmp_path / "models")
    agent = make_agent(
        broker,
        models,
        MQTT__RECONNECT_MIN_S="0.05",
        MQTT__RECONNECT_MAX_S="0.3",
        MQTT__REPLAY_AFTER_RECONNECT_S="0",  # only the application-level resend recovers
    )
    steps = 1500
    results: dict[int, tuple[list, object]] = {}
    client = AgentClient(broker.host, broker.port, device_id=agent.config.device_id).connect()
    try:
        replies = [
            client.request(
                "decoder",
                {"token": np.array([[i + 1]], dtype=np.int64)},
                params={"max_steps": steps},
                timeout=60,
            )
            for i in range(4)
        ]

        def consume(i: int) -> None:
            try:
                results[i] = (list(replies[i]), None)
            except Exception as e:  # reported below
                results[i] = ([], e)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in range(3):
            time.sleep(0.7)
            broker.kill()
            time.sleep(0.3)
            broker.start()
        for t in threads:
            t.join(120)
        for i in range(4):
            chunks, error = results[i]
            assert error is None, (
                f"stream {i}: {error}; counters {dict(agent.counters)}, "
                f"spool {agent.spool.count if agent.spool else None}, "
                f"resender {vars(agent.resender) if agent.resender else None}"
            )
            assert [c.seq for c in chunks] == list(range(steps))
            assert [c.index for c in chunks] == list(range(steps))
            assert replies[i].end is not None and replies[i].end.chunks == steps
        recovered = sum(r.recovered for r in replies)
        asked = sum(r.resend_requests for r in replies)
        record_property("messages_recovered_by_resend", recovered)
        record_property("resend_requests", asked)
        print(f"\nresend: {asked} requests, {recovered} messages recovered")
        assert agent.transport.reconnects >= 3
    finally:
        client.close()
        broker.close()


def test_a_quiet_stream_is_asked_for_again_at_a_bounded_pace():
    """A stream that stays silent is asked for with growing pauses until its timeout, never
    in a loop: the pause stops growing at 16 x `quiet_s`, counted from the last ask."""
    from agent.client import Reply, ReplyTimeout

    asks: list[float] = []
    reply = Reply("req-quiet", "t", timeout=1.5, _ask=lambda body: asks.append(time.monotonic()))
    reply.quiet_s = 0.01  # asks after 0.01, 0.02, 0.04, 0.08, then every 0.16 s
    started = time.monotonic()
    with pytest.raises(ReplyTimeout):
        list(reply)
    assert reply.resend_requests == len(asks)
    # 4 asks in the first 0.15 s, then one every 0.16 s: about 12 in 1.5 s (a loop: millions)
    assert 6 <= len(asks) <= 14, len(asks)
    pauses = [b - a for a, b in zip([started, *asks[:-1]], asks, strict=True)]
    assert min(pauses[4:]) >= 0.16 * 0.9, pauses


def _held_stream(spool, rid: str, seqs: range) -> list[int]:
    """Spool ids of one run of stream `rid`'s messages (seqs as given), written and acked."""
    from agent.delivery.outbox import OutMessage

    items = []
    for seq in seqs:
        out = OutMessage(f"t/{rid}", b"%d" % seq, 1, stream=f"m/{rid}", rid=rid, seq=seq)
        out.spool_id = spool.allocate_id()
        items.append(out)
    ids = [m.spool_id for m in items]
    spool.write(items, ids, 0)
    return ids


def test_a_stream_held_twice_is_resent_once_per_seq(tmp_path):
    """A request that ran twice (redelivered after it finished) holds every seq twice; a
    resend carries each seq once, the first run's."""
    from agent.delivery.spool import Spool

    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=100_000)
    first = _held_stream(spool, "r1", range(50))
    _held_stream(spool, "r1", range(50))
    held = spool.held("r1", None, 10)
    assert [m.id for m in held] == first[10:]
    assert [m.id for m in spool.held("r1", (3, 7), None)] == [first[3], first[7]]
    spool.close()


def test_a_stream_longer_than_the_message_bucket_is_resent_in_pieces(tmp_path):
    """`messages_per_s` bounds one answer, it does not refuse it: a stream longer than the
    bucket goes out as far as the bucket allows, and the next ask gets the rest."""
    from agent.delivery.outbox import OutMessage
    from agent.delivery.resend import Resender, ResendRequest
    from agent.delivery.spool import Spool

    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=100_000)
    ids = _held_stream(spool, "long", range(30))
    sent: list[OutMessage] = []
    resender = Resender(
        spool, lambda m: sent.append(m) or True, lambda c: None,
        requests_per_s=100, messages_per_s=12, gone_qos=1,
    )  # fmt: skip
    resender.handle(ResendRequest("long", 0, None, None))
    assert [m.payload for m in sent] == [b"%d" % s for s in range(12)]
    # Copies, never stored again, judged as their stored messages (`agent.mqtt.poison`).
    assert [(m.spool_id, m.copy_of) for m in sent] == [(None, i) for i in ids[:12]]
    resender.handle(ResendRequest("long", 12, None, None))  # at once: the bucket is empty
    assert len(sent) == 12 and resender.limited == 1
    time.sleep(1.1)  # 12 tokens a second
    resender.handle(ResendRequest("long", 12, None, None))
    assert [m.payload for m in sent] == [b"%d" % s for s in range(24)]
    assert resender.answered == 2
    spool.close()


def test_a_late_subscriber_gets_the_whole_stream(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    body = {
        "id": "late-1",
        "inputs": {"token": np.array([[1]], dtype=np.int64)},
        "params": {"max_steps": 7},
    }
    client.publish_raw(f"{agent.root}/infer/decoder", encode_payload(body))
    deadline = time.monotonic() + 5
    while agent.counters["requests_ok"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # acknowledged by the broker: now history in the spool
    reply = client.replay("decoder", "late-1")
    chunks = list(reply)
    assert [c.seq for c in chunks] == list(range(7))
    assert reply.end is not None and reply.end.chunks == 7


def test_old_or_unknown_streams_are_gone(broker, repository, make_agent, make_client):
    agent = make_agent(
        broker, repository, RESEND__WINDOW_S="0.5", MQTT__REPLAY_AFTER_RECONNECT_S="0"
    )
    client = make_client(broker, agent)
    with pytest.raises(AgentError) as info:
        list(client.replay("decoder", "never-ran", timeout=5))
    assert info.value.code == "gone"
    list(
        client.request(
            "decoder",
            {"token": np.array([[1]], dtype=np.int64)},
            request_id="old-1",
            params={"max_steps": 2},
        )
    )
    time.sleep(1.5)  # past the window; housekeeping forgets it
    topic = f"{agent.root}/result/decoder/old-1"
    got: queue.Queue[dict] = queue.Queue()
    client.listen(topic, lambda t, m, raw: got.put(m))
    client.publish_raw(
        f"{agent.root}/resend",
        encode_payload({"id": "old-1", "from_seq": 0, "model": "decoder"}),
    )
    message = got.get(timeout=5)
    assert message == {"v": 1, "id": "old-1", "type": "gone", "seq": None}

    # The contract's own ask names no model: a stream not held whose request was recent (a
    # QoS 0 one, never stored; one past the window) gets `gone` on its reply topic.
    for request_id, qos in (("quick-0", 0), ("old-1", 1)):
        if qos == 0:
            list(
                client.request(
                    "decoder",
                    {"token": np.array([[1]], dtype=np.int64)},
                    request_id=request_id,
                    params={"max_steps": 2},
                    reply_qos=0,
                )
            )
        topic = f"{agent.root}/result/decoder/{request_id}"
        answers: queue.Queue[dict] = queue.Queue()
        client.listen(topic, lambda t, m, raw, answers=answers: answers.put(m))
        time.sleep(0.1)  # subscribed
        ask = {"id": request_id, "from_seq": 0}
        client.publish_raw(f"{agent.root}/resend", encode_payload(ask))
        message = answers.get(timeout=5)
        assert message == {"v": 1, "id": request_id, "type": "gone", "seq": None}


def test_resend_requests_are_validated_and_rate_limited(
    broker, repository, make_agent, make_client
):
    agent = make_agent(broker, repository, RESEND__REQUESTS_PER_S="5")
    client = make_client(broker, agent)
    events: queue.Queue[dict] = queue.Queue()
    client.listen(f"{agent.root}/events", lambda t, m, raw: events.put(m))
    list(
        client.request(
            "decoder",
            {"token": np.array([[1]], dtype=np.int64)},
            request_id="rl-1",
            params={"max_steps": 2},
        )
    )
    bad = [
        b"\xff\x00",
        encode_payload({"id": "x y", "from_seq": 0}),
        encode_payload({"id": "rl-1"}),
        encode_payload({"id": "rl-1", "seqs": [-1]}),
        encode_payload({"id": "rl-1", "from_seq": 0, "extra": 1}),
        encode_payload({"id": "rl-1", "seqs": list(range(2000))}),
    ]
    for payload in bad * 10:
        client.publish_raw(f"{agent.root}/resend", payload)
    for _ in range(10):  # the same ask again and again: answered once
        client.publish_raw(f"{agent.root}/resend", encode_payload({"id": "rl-1", "from_seq": 0}))
    for i in range(50):  # distinct asks: the token bucket (5 a second) drops most
        client.publish_raw(f"{agent.root}/resend", encode_payload({"id": "rl-1", "seqs": [i]}))
    deadline = time.monotonic() + 5
    counted = 0
    while counted < len(bad) * 10 and time.monotonic() < deadline:
        try:
            event = events.get(timeout=0.2)
        except queue.Empty:
            continue
        if event["type"] == "bad_request":
            counted += event["count"]
    assert counted == len(bad) * 10
    assert agent.resender is not None
    assert agent.resender.limited > 0 and agent.resender.repeated > 0
    # The agent still serves.
    assert (
        len(
            list(
                client.request(
                    "decoder", {"token": np.array([[1]], dtype=np.int64)}, params={"max_steps": 3}
                )
            )
        )
        == 3
    )
