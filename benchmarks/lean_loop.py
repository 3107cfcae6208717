"""The scan section's reference row: what one message a window leaves of the bare rate on this
machine when no agent is involved at all.

The loop is the bare loop (`InferenceSession.run` over the windows, the state fed back) that
also makes each window's chunk with the protocol's own functions (`reply_envelope`,
`encode_payload`) and publishes it at QoS 1 on a minimal MQTT client
(`benchmarks.lean_mqtt`), in the loop's own thread: the packets of 8 windows in one write, the
broker's acknowledgements read without waiting after each write, a C subscriber
(`mosquitto_sub`, as for the agent's rows, its output to a file) taking every message from the
broker. No spool, no other thread, no checks: about the least one message a window costs a
publisher written in Python. Rounds alternate bare, lean, bare; the figure is the median of
the rounds' lean / mean of the bare runs around it (decision 0040).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent.demo.broker import EmbeddedBroker
from agent.protocol.payload import encode_payload
from agent.protocol.replies import reply_envelope
from benchmarks.lean_mqtt import LeanClient

PER_WRITE = 8  # windows' packets a socket write carries
TOPIC = "edge/bench-lean/result/vad/lean"


def _subscriber(
    broker: EmbeddedBroker, workdir: Path, client: LeanClient
) -> subprocess.Popen[bytes]:
    """`mosquitto_sub` at QoS 1 writing to a file, once a probe through the broker reached it."""
    out = workdir / "lean-sub.txt"
    command = ["mosquitto_sub", "-h", broker.host, "-p", str(broker.port), "-t", TOPIC]
    command += ["-q", "1", "-F", "%U", "--nodelay"]  # a receive time a message, as the agent's rows
    with out.open("wb") as sink:
        sub = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 10
    while not out.stat().st_size:
        if time.monotonic() > deadline or sub.poll() is not None:
            sub.kill()
            raise RuntimeError("mosquitto_sub did not subscribe for the lean loop")
        client.sock.sendall(client.publish_packet(TOPIC, b"probe", 0))
        time.sleep(0.05)
    return sub


class LeanLoop:
    """One session, one connection; `bare()` and `lean()` give windows a second."""

    def __init__(self, session: Any, windows: Sequence[np.ndarray], feed: dict[str, Any]):
        self.session = session
        self.windows = windows
        self.feed = feed  # the inputs every window shares (`sr`)
        self.client: LeanClient | None = None

    def _state(self) -> np.ndarray:
        return np.zeros((2, 1, 128), np.float32)

    def bare(self) -> float:
        run, feed, state = self.session.run, self.feed, self._state()
        started = time.perf_counter()
        for window in self.windows:
            _, state = run(None, {**feed, "input": window, "state": state})
        return len(self.windows) / (time.perf_counter() - started)

    def lean(self) -> float:
        client = self.client
        assert client is not None
        run, feed, state = self.session.run, self.feed, self._state()
        waiting: list[bytes] = []
        started = time.perf_counter()
        for n, window in enumerate(self.windows):
            output, state = run(None, {**feed, "input": window, "state": state})
            fields = reply_envelope(
                request_id="lean", seq=n, type="chunk", model="vad", version=1, index=n
            )
            fields["offset"] = n * 512
            fields["outputs"] = {"output": output}
            waiting.append(client.publish_packet(TOPIC, encode_payload(fields), 1))
            if len(waiting) == PER_WRITE:
                client.sock.sendall(b"".join(waiting))
                waiting.clear()
                client.read(0)  # the acknowledgements already there
        client.sock.sendall(b"".join(waiting))
        return len(self.windows) / (time.perf_counter() - started)


def lean_vs_bare(
    broker: EmbeddedBroker, workdir: Path, session: Any, windows: Sequence[np.ndarray], rounds: int
) -> tuple[float, float, float]:
    """(bare windows/s, lean windows/s, median of the rounds' lean / bare), both in this
    thread with `session` (its `sr` given as 16 kHz)."""
    loop = LeanLoop(session, windows, {"sr": np.array(16000, dtype=np.int64)})
    loop.client = LeanClient(broker.host, broker.port, "bench-lean")
    subscriber = _subscriber(broker, workdir, loop.client)
    try:
        loop.bare()
        loop.lean()  # warm
        bare_rates, lean_rates, ratios = [], [], []
        before = loop.bare()
        for _ in range(rounds):
            lean = loop.lean()
            after = loop.bare()
            bare_rates.append(after)
            lean_rates.append(lean)
            ratios.append(lean / ((before + after) / 2))
            before = after
        med = statistics.median
        return med(bare_rates), med(lean_rates), med(ratios)
    finally:
        loop.client.close()
        subscriber.terminate()
        subscriber.wait(10)
