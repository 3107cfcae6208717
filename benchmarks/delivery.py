"""Backlog drain after a broker outage: the spool's read-back rate against the live rate."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt

from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.demo.run import DECODER_CONFIG
from agent.protocol.payload import encode_payload

MODEL = "decoder-long"
CONFIG = DECODER_CONFIG.format(steps=100000)  # the demo decoder's, with long streams


@dataclass
class DrainResult:
    live_rate: float
    drain_rate: float
    outage_s: float
    backlog: int

    @property
    def ratio(self) -> float:
        return self.drain_rate / self.live_rate


def add_model(repository: Path) -> None:
    (repository / MODEL / "1").mkdir(parents=True)
    demo_models.save(demo_models.gru_decoder(), repository / MODEL / "1" / "model.onnx")
    (repository / MODEL / "config.toml").write_text(CONFIG)


class Counter:
    """A bare paho subscriber that counts reply messages (it resubscribes after a restart)."""

    def __init__(self, broker: EmbeddedBroker, pattern: str) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.reconnect_delay_set(0.05, 0.2)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(pattern, 1)
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: object, message: object) -> None:
        with self._lock:
            self.count += 1

    def rate_over(self, seconds: float) -> tuple[float, int]:
        start = self.count
        time.sleep(seconds)
        got = self.count - start
        return got / seconds, got

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def measure_drain(
    broker: EmbeddedBroker, root: str, outage_s: float, window_s: float
) -> DrainResult:
    """Streams that produce faster than MQTT can carry them; the broker goes away for
    `outage_s`; the publish rate after it returns (the backlog read back from the spool)
    against the rate before it left."""
    counter = Counter(broker, f"{root}/result/#")
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    publisher.connect(broker.host, broker.port)
    publisher.loop_start()
    try:
        time.sleep(0.3)
        for i in range(2):
            body = {
                "id": f"drain-{i}",
                "inputs": {"token": np.array([[i + 1]], dtype=np.int64)},
                "params": {"max_steps": 100000},
            }
            publisher.publish(f"{root}/infer/{MODEL}", encode_payload(body), 1).wait_for_publish(5)
        time.sleep(1.0)
        live_rate, _ = counter.rate_over(window_s)
        broker.stop()
        time.sleep(outage_s)
        broker.start()
        time.sleep(0.5)  # reconnects (agent backoff is capped low for the benchmark)
        drain_rate, drained = counter.rate_over(window_s)
        return DrainResult(live_rate, drain_rate, outage_s, drained)
    finally:
        publisher.disconnect()
        publisher.loop_stop()
        counter.close()


def section(drain: DrainResult) -> list[str]:
    verdict = "met" if drain.ratio >= 0.5 else "**missed**"
    return [
        "## Backlog after a broker outage",
        "",
        "Two long decoder streams (QoS 1) produce faster than MQTT carries them, so the "
        "publisher is the bottleneck and the spool holds the rest. The broker is stopped for "
        f"{drain.outage_s:.0f} s while the streams go on (everything goes to the spool), then "
        "started again. Rates are reply messages per second counted by a bare paho subscriber.",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| live publish rate (before the outage) | {drain.live_rate:.0f} msg/s | report |",
        f"| drain rate (after the outage, from the spool) | {drain.drain_rate:.0f} msg/s "
        f"({drain.backlog} messages in the window) | report |",
        f"| drain / live | **{drain.ratio:.2f}** | >= 0.5 {verdict} |",
        "",
    ]
