"""The benchmarks' minimal MQTT client (benchmarks.lean_mqtt), which drives the batching figure:
it must speak MQTT to a real Mosquitto as paho does, or the figure measures nothing."""

from __future__ import annotations

import os
import time
import uuid

from agent.broker import EmbeddedBroker
from benchmarks.harness import cpu_s
from benchmarks.lean_mqtt import PUBLISH, LeanClient, parse_publish, puback


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
