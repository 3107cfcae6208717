"""Live request latency while 1,000 resend requests a second arrive (the rate limit's job)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from agent.client import AgentClient
from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.demo.run import DECODER_CONFIG
from agent.protocol.payload import encode_payload
from benchmarks.hot_swap import _p

MODEL = "decoder-tiny"


def add_model(repository: Path) -> None:
    """The 32-step tiny decoder the live requests and the held stream use."""
    (repository / MODEL / "1").mkdir(parents=True)
    demo_models.save(demo_models.gru_decoder(), repository / MODEL / "1" / "model.onnx")
    (repository / MODEL / "config.toml").write_text(DECODER_CONFIG.format(steps=32))


@dataclass
class ResendFloodResult:
    p99_base_ms: float
    p99_flood_ms: float
    flood_rate: float
    requests: int

    @property
    def ratio(self) -> float:
        return self.p99_flood_ms / self.p99_base_ms


def _latencies(client: AgentClient, seconds: float) -> list[float]:
    token = {"token": np.array([[1]], dtype=np.int64)}
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        list(client.request(MODEL, token, params={"max_steps": 4}, timeout=10))
        out.append(time.perf_counter() - started)
        time.sleep(max(0.0, 0.01 - (time.perf_counter() - started)))
    return out


def measure_flood(
    client: AgentClient, broker: EmbeddedBroker, root: str, seconds: float, rate: float = 1000.0
) -> ResendFloodResult:
    token = {"token": np.array([[1]], dtype=np.int64)}
    list(client.request(MODEL, token, request_id="flood-src", timeout=10))  # a held stream
    for _ in range(20):
        list(client.request(MODEL, token, params={"max_steps": 4}))
    base = _latencies(client, seconds)

    stop = threading.Event()
    sent = [0]
    flooder = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    flooder.connect(broker.host, broker.port)
    flooder.loop_start()
    payload = encode_payload({"id": "flood-src", "from_seq": 0})

    def flood() -> None:
        interval = 1.0 / rate
        next_at = time.perf_counter()
        while not stop.is_set():
            flooder.publish(f"{root}/resend", payload, 0)
            sent[0] += 1
            next_at += interval
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    thread = threading.Thread(target=flood, name="bench-resend-flood")
    started = time.monotonic()
    thread.start()
    try:
        during = _latencies(client, seconds)
    finally:
        stop.set()
        thread.join()
        flooder.disconnect()
        flooder.loop_stop()
    rate_seen = sent[0] / (time.monotonic() - started)
    return ResendFloodResult(_p(base, 0.99), _p(during, 0.99), rate_seen, len(during))


def section(flood: ResendFloodResult) -> list[str]:
    verdict = "met" if flood.ratio <= 2 else "**missed**"
    return [
        "## Resend flood",
        "",
        "Live 4-step decoder requests, one every 10 ms, first alone, then while another client "
        f"publishes {flood.flood_rate:.0f} resend requests a second for a held 32-step stream "
        "(the agent ignores the same request within a second, rate-limits the rest with a "
        "token bucket, and publishes resends only when no live message waits).",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| live p99 latency, alone / during the flood | {flood.p99_base_ms:.2f} ms / "
        f"{flood.p99_flood_ms:.2f} ms | report |",
        f"| p99 during / p99 alone | **{flood.ratio:.2f}** | <= 2 {verdict} |",
        "",
    ]
