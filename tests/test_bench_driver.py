"""The benchmarks' own machinery: the minimal MQTT client (benchmarks.lean_mqtt) that drives the
batching figure must speak MQTT to a real Mosquitto as paho does, and the sources figure's
estimator must cancel the drift it is there to cancel, or the figures measure nothing."""

from __future__ import annotations

import os
import statistics
import time
import uuid

import pytest

from agent.demo.broker import EmbeddedBroker
from benchmarks.harness import cpu_s
from benchmarks.lean_mqtt import PUBLISH, LeanClient, parse_publish, puback
from benchmarks.sources import paired_ratio, turn_rate


def test_lean_client_publishes_and_reads_back_at_qos_0_and_1(broker: EmbeddedBroker) -> None:
    topic = f"test/lean/{uuid.uuid4().hex}"
    client = LeanClient(broker.host, broker.port, f"lean-{uuid.uuid4().hex[:8]}")
    try:
        client.subscribe(f"{topic}/#", 1)
        sent = [(f"{topic}/{i}", bytes([i % 256]) * (i * 997), i % 2) for i in range(40)]
        client.sock.sendall(b"".join(client.publish_packet(t, p, q) for t, p, q in sent))
        got: list[tuple[str, bytes, int]] = []
        acks, expected_acks = 0, sum(q for _, _, q in sent)
        deadline = time.monotonic() + 10
        while (len(got) < len(sent) or acks < expected_acks) and time.monotonic() < deadline:
            out = []
            for first, body in client.read(0.5):
                if first >> 4 == PUBLISH:
                    mid, payload = parse_publish(first, body)
                    name = body[2 : 2 + (body[0] << 8 | body[1])].decode()
                    got.append((name, payload, (first >> 1) & 3))
                    if mid is not None:
                        out.append(puback(mid))
                elif first >> 4 == 4:
                    acks += 1  # the broker's PUBACK of one of ours
            client.sock.sendall(b"".join(out))
        # Payloads up to 39 kB: remaining lengths of one to three bytes, reads cut anywhere.
        assert got == sent
        assert acks == expected_acks
    finally:
        client.close()


def test_cpu_time_of_a_process_counts_its_work() -> None:
    """The batching figure's CPU per request comes from this reading of /proc."""
    before = cpu_s(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    spent = cpu_s(os.getpid()) - before
    assert 0.2 <= spent <= 5.0


def test_paired_ratio_follows_the_machine_where_a_ratio_of_medians_does_not() -> None:
    """The machine slows down half way (100 fps, then 70); the agent runs at 0.9 of whatever
    the bare loop gets at the time."""
    speed = [100.0] * 10 + [70.0] * 11
    bare = speed[0::2]  # bare, agent, bare, agent, ..., bare: 11 bare turns, 10 agent turns
    agent = [0.9 * s for s in speed[1::2]]
    assert paired_ratio(agent, bare) == pytest.approx(0.9)
    # The medians fall on different sides of the change: the agent looks faster than bare.
    assert statistics.median(agent) / statistics.median(bare) == pytest.approx(76.5 / 70)
    # A turn caught half in a slow phase is one outlier among the pairs, not a shift.
    agent[3] = 40.0
    assert paired_ratio(agent, bare) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="one reference turn before each"):
        paired_ratio(agent, bare[:-1])


def test_turn_rate_is_frames_over_the_emit_times_they_span() -> None:
    second = 1_000_000_000
    frames = [(i * 2, 5 * second + i * second // 50) for i in range(26)]  # 50 fps, 25 periods
    assert turn_rate(frames) == pytest.approx(50.0)
    assert turn_rate(frames[:1]) == 0.0  # a stalled agent counts as a zero-rate turn
