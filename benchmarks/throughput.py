"""Throughput and latency against the baselines of issue 7: raw paho, a naive loop, bare ORT.

- raw: paho publishing the agent's own chunk payload at QoS 0/1/2 to the same broker, a bare
  paho subscriber (its own client and network thread) counting them.
- agent: one long streamed decoder request per QoS, counted by the same kind of subscriber.
- naive: the hand-written loop: `session.run`, `json.dumps`, publish QoS 1,
  `wait_for_publish`, next.
- bare: `InferenceSession.run` alone, plus a paho echo round trip, against the agent's
  median latency for a 1-chunk request.

TCP_NODELAY is set on every paho socket here (as the agent and the SDK do), so the
baselines are the strongest a Python client gets on this broker.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt

from agent import demo_models, wire
from agent.broker import EmbeddedBroker
from agent.client import AgentClient
from agent.demo import DECODER_CONFIG

STREAM_MODEL = "decoder-stream"
TINY_MODEL = "decoder-tiny"
HIDDEN = 32  # the tiny decoder's (vocab 32, embed 16, hidden 32)
CONFIG = DECODER_CONFIG.format(steps=100000)  # the demo decoder's, with long streams
TARGETS = {0: 0.7, 1: 0.8, 2: 0.7}
NAIVE_TARGET = 3.0
LATENCY_TARGET = 1.5
AHEAD = 500  # raw publisher: at most this many messages ahead of the subscriber


@dataclass
class RateResult:
    qos: int
    payload_bytes: int
    raw_rate: float  # msg/s at the subscriber
    agent_rate: float  # chunks/s at the subscriber
    agent_chunks: int

    @property
    def ratio(self) -> float:
        return self.agent_rate / self.raw_rate

    @property
    def target(self) -> float:
        return TARGETS[self.qos]


@dataclass
class NaiveResult:
    steps_per_s: float
    agent_rate: float  # agent chunks/s at QoS 1, from the same run

    @property
    def ratio(self) -> float:
        return self.agent_rate / self.steps_per_s


@dataclass
class LatencyResult:
    bare_us: float  # one InferenceSession.run of the tiny decoder step
    round_trip_ms: float  # median paho echo round trip, request and chunk payloads
    agent_ms: float  # median 1-chunk request through the agent (SDK, QoS 1)
    requests: int

    @property
    def ratio(self) -> float:
        return self.agent_ms / (self.bare_us / 1000 + self.round_trip_ms)


def add_model(repository: Path) -> None:
    (repository / STREAM_MODEL / "1").mkdir(parents=True)
    model = demo_models.gru_decoder(vocab=32, embed=16, hidden=HIDDEN)
    demo_models.save(model, repository / STREAM_MODEL / "1" / "model.onnx")
    (repository / STREAM_MODEL / "config.toml").write_text(CONFIG)


def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _client(broker: EmbeddedBroker) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.on_socket_open = _nodelay
    client.connect(broker.host, broker.port)
    client.loop_start()
    return client


def _close(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


class Subscriber:
    """A bare paho subscriber on its own network thread: arrival times and payloads."""

    def __init__(self, broker: EmbeddedBroker, topic: str, qos: int, keep: bool = False) -> None:
        self.arrivals: list[float] = []
        self.payloads: list[bytes] = []
        self._keep = keep
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_socket_open = _nodelay
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(topic, qos)
        self.client.on_subscribe = lambda c, u, mid, rc, p: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError(f"no SUBACK for {topic}")

    def _on_message(self, client: mqtt.Client, userdata: object, message: Any) -> None:
        self.arrivals.append(time.perf_counter())
        if self._keep:
            self.payloads.append(bytes(message.payload))

    @property
    def count(self) -> int:
        return len(self.arrivals)

    def wait_for(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.count < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.count >= n

    def close(self) -> None:
        _close(self.client)


def _rate(arrivals: list[float], skip_s: float = 0.2) -> float:
    """Messages per second after the first `skip_s` (start-up) to the last arrival."""
    if len(arrivals) < 2:
        return 0.0
    start = arrivals[0] + min(skip_s, (arrivals[-1] - arrivals[0]) / 4)
    kept = [t for t in arrivals if t >= start]
    return (len(kept) - 1) / (kept[-1] - kept[0]) if len(kept) > 1 else 0.0


def _token() -> dict[str, np.ndarray]:
    return {"token": np.array([[1]], dtype=np.int64)}


def _stream_body(request_id: str, steps: int, qos: int) -> bytes:
    body = {"id": request_id, "inputs": _token(), "params": {"max_steps": steps}, "qos": qos}
    return wire.encode_payload(body)


def chunk_payload(broker: EmbeddedBroker, root: str) -> bytes:
    """A real chunk message of the tiny decoder, as the agent publishes it."""
    request_id = uuid.uuid4().hex[:16]
    sub = Subscriber(broker, f"{root}/result/{STREAM_MODEL}/{request_id}", 1, keep=True)
    pub = _client(broker)
    try:
        topic = f"{root}/infer/{STREAM_MODEL}"
        pub.publish(topic, _stream_body(request_id, 8, 1), 1).wait_for_publish(5)
        if not sub.wait_for(8, 10):
            raise RuntimeError("no chunks from the agent")
        return sub.payloads[len(sub.payloads) // 2]  # a middle one: no start or end markers
    finally:
        _close(pub)
        sub.close()


def measure_raw(broker: EmbeddedBroker, payload: bytes, qos: int, seconds: float) -> float:
    """paho publishing `payload` at `qos` as fast as the subscriber takes it: msg/s there."""
    topic = f"bench/raw/{uuid.uuid4().hex[:8]}"
    sub = Subscriber(broker, topic, qos)
    pub = _client(broker)
    stop = threading.Event()

    def publish() -> None:
        sent = 0
        while not stop.is_set():
            if sent - sub.count < AHEAD:
                pub.publish(topic, payload, qos)
                sent += 1
            else:
                time.sleep(0.0002)

    thread = threading.Thread(target=publish, name="bench-raw-publisher")
    thread.start()
    try:
        time.sleep(0.3)
        c0, t0 = sub.count, time.perf_counter()
        time.sleep(seconds)
        c1, t1 = sub.count, time.perf_counter()
    finally:
        stop.set()
        thread.join()
        _close(pub)
        sub.close()
    return (c1 - c0) / (t1 - t0)


def _agent_stream(broker: EmbeddedBroker, root: str, qos: int, steps: int) -> float:
    request_id = uuid.uuid4().hex[:16]
    sub = Subscriber(broker, f"{root}/result/{STREAM_MODEL}/{request_id}", qos)
    pub = _client(broker)
    try:
        topic = f"{root}/infer/{STREAM_MODEL}"
        pub.publish(topic, _stream_body(request_id, steps, qos), 1).wait_for_publish(5)
        # the stream is not cancellable: wait for all of it (a generous cap)
        if not sub.wait_for(steps, max(30.0, steps / 200)):
            raise RuntimeError(f"QoS {qos} stream: {sub.count} of {steps} chunks arrived")
        return _rate(sub.arrivals)
    finally:
        _close(pub)
        sub.close()


def measure_agent(broker: EmbeddedBroker, root: str, qos: int, seconds: float) -> tuple[float, int]:
    """Chunks/s at a bare subscriber for one long stream: a 500-step probe sizes the stream
    so that it lasts about `seconds`."""
    probe = _agent_stream(broker, root, qos, 500)
    steps = max(500, int(probe * seconds))
    return _agent_stream(broker, root, qos, steps), steps


def measure_rates(
    client: AgentClient, broker: EmbeddedBroker, root: str, seconds: float
) -> list[RateResult]:
    list(client.request(STREAM_MODEL, _token(), params={"max_steps": 1}, timeout=30))  # loaded
    payload = chunk_payload(broker, root)
    results = []
    for qos in (0, 1, 2):
        raw = measure_raw(broker, payload, qos, seconds)
        agent, chunks = measure_agent(broker, root, qos, seconds)
        results.append(RateResult(qos, len(payload), raw, agent, chunks))
    return results


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def measure_naive(
    broker: EmbeddedBroker, model_path: Path, threads: int, seconds: float, agent_rate: float
) -> NaiveResult:
    """The loop people write: run a step, `json.dumps` it, publish QoS 1, wait, next."""
    session = _session(model_path, threads)
    pub = _client(broker)
    topic = f"bench/naive/{uuid.uuid4().hex[:8]}"
    token = np.array([[1]], dtype=np.int64)
    h = np.zeros((1, HIDDEN), np.float32)
    steps = 0
    try:
        end = time.perf_counter() + 0.2 + seconds
        started = None
        while (now := time.perf_counter()) < end:
            if started is None and now >= end - seconds:
                started, steps = now, 0
            token, _logits, h = session.run(None, {"token": token, "h": h})
            pub.publish(topic, json.dumps(token.tolist()), 1).wait_for_publish(5)
            steps += 1
        elapsed = time.perf_counter() - (started or end)
    finally:
        _close(pub)
    return NaiveResult(steps / elapsed, agent_rate)


def bare_us(model_path: Path, threads: int, n: int = 2000) -> float:
    session = _session(model_path, threads)
    feed = {"token": np.array([[1]], dtype=np.int64), "h": np.zeros((1, HIDDEN), np.float32)}
    for _ in range(50):
        session.run(None, feed)
    started = time.perf_counter()
    for _ in range(n):
        session.run(None, feed)
    return (time.perf_counter() - started) / n * 1e6


def echo_round_trip_ms(
    broker: EmbeddedBroker, request: bytes, reply: bytes, seconds: float
) -> float:
    """Median paho round trip, QoS 1 both ways: publish on A, a second client echoes on B."""
    a, b = f"bench/echo/{uuid.uuid4().hex[:8]}/a", f"bench/echo/{uuid.uuid4().hex[:8]}/b"
    echo = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    echo.on_socket_open = _nodelay
    ready = threading.Event()
    echo.on_connect = lambda c, u, f, rc, p: c.subscribe(a, 1)
    echo.on_subscribe = lambda c, u, mid, rc, p: ready.set()
    echo.on_message = lambda c, u, m: c.publish(b, reply, 1)
    echo.connect(broker.host, broker.port)
    echo.loop_start()
    if not ready.wait(10):
        raise RuntimeError("echo client not subscribed")
    got = threading.Event()
    sub = Subscriber(broker, b, 1)
    sub.client.on_message = lambda c, u, m: got.set()
    pub = _client(broker)
    times = []
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 20:
            got.clear()
            started = time.perf_counter()
            pub.publish(a, request, 1)
            if not got.wait(5):
                raise RuntimeError("echo round trip timed out")
            times.append(time.perf_counter() - started)
    finally:
        _close(pub)
        sub.close()
        _close(echo)
    return statistics.median(times[10:]) * 1000


def measure_latency(
    client: AgentClient,
    broker: EmbeddedBroker,
    root: str,
    model_path: Path,
    threads: int,
    seconds: float,
) -> LatencyResult:
    """Median 1-chunk tiny request through the agent against bare run + paho round trip."""
    params = {"max_steps": 1}
    for _ in range(20):
        list(client.request(TINY_MODEL, _token(), params=params, timeout=10))
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        list(client.request(TINY_MODEL, _token(), params=params, timeout=10))
        latencies.append(time.perf_counter() - started)
    request_id = uuid.uuid4().hex[:16]
    request = wire.encode_payload({"id": request_id, "inputs": _token(), "params": params})
    reply = chunk_payload(broker, root)
    round_trip = echo_round_trip_ms(broker, request, reply, seconds)
    return LatencyResult(
        bare_us(model_path, threads),
        round_trip,
        statistics.median(latencies) * 1000,
        len(latencies),
    )


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def throughput_section(
    rates: list[RateResult], naive: NaiveResult, latency: LatencyResult
) -> list[str]:
    payload = rates[0].payload_bytes if rates else 0
    lines = [
        "## Throughput and latency against the baselines",
        "",
        f"Same broker, same run. **raw**: paho publishing the agent's own chunk message "
        f"({payload} bytes, taken from a real reply of the tiny decoder) at the given QoS, "
        "counted by a bare paho subscriber (separate client, own network thread). **agent**: "
        f"one long streamed request to the tiny GRU decoder (`{STREAM_MODEL}`, vocab 32, "
        "hidden 32), reply QoS set by the request's `qos` key, counted by the same kind of "
        "subscriber on the reply topic (not the SDK). **naive**: the hand-written loop "
        "(`session.run`, `json.dumps(token.tolist())`, publish QoS 1, `wait_for_publish`, "
        "next). **bare**: `InferenceSession.run` alone on the same inputs. TCP_NODELAY on "
        "every baseline socket too, so the baselines are the strongest plain paho gets.",
        "",
        "| figure | agent | baseline | ratio | target |",
        "|---|---|---|---|---|",
    ]
    for r in rates:
        lines.append(
            f"| chunks/s, QoS {r.qos}: agent / raw paho | {r.agent_rate:.0f} msg/s "
            f"({r.agent_chunks} chunks) | {r.raw_rate:.0f} msg/s | **{r.ratio:.2f}** | "
            f">= {r.target:.1f} {_verdict(r.ratio >= r.target)} |"
        )
    lines += [
        f"| chunks/s, QoS 1: agent / naive loop | {naive.agent_rate:.0f} msg/s | "
        f"{naive.steps_per_s:.0f} steps/s | **{naive.ratio:.2f}** | >= {NAIVE_TARGET:.1f} "
        f"{_verdict(naive.ratio >= NAIVE_TARGET)} |",
        f"| median latency, 1-chunk tiny request: agent / (bare run + paho round trip) | "
        f"{latency.agent_ms:.2f} ms ({latency.requests} requests) | "
        f"{latency.bare_us:.0f} µs + {latency.round_trip_ms:.2f} ms | **{latency.ratio:.2f}** | "
        f"<= {LATENCY_TARGET:.1f} {_verdict(latency.ratio <= LATENCY_TARGET)} |",
        "",
    ]
    return lines
