"""Reference rows with no agent at all: what one message a window (scan) or a token (generate)
leaves of the bare rate on this machine.

A lean loop is the section's bare loop that also makes each window's or token's chunk with the
protocol's own functions (`reply_envelope`, `encode_payload`) and publishes it at QoS 1 on a
minimal MQTT client (`benchmarks.lean_mqtt`), in the loop's own thread (`LeanPublisher`). It
writes as the agent's send hold does: the first message at once, then what waits in one write
once the oldest waited `HOLD_MAX_S` (or `HOLD_MAX_MESSAGES` wait). It reads the broker's
acknowledgements without waiting after each write. A C subscriber (`mosquitto_sub`, as for
the agent's rows) takes every message from the broker. No spool, no other thread, no checks:
about the least one message costs a publisher written in Python (decision 0040).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.demo.broker import EmbeddedBroker
from agent.inference.send_hold import HOLD_MAX_MESSAGES, HOLD_MAX_S
from agent.protocol.payload import encode_payload
from agent.protocol.replies import reply_envelope
from benchmarks.lean_mqtt import LeanClient

TOPIC = "edge/bench-lean/result/model/lean"


class LeanPublisher:
    """One connection and its subscriber; `chunk()` a message, `end()` after a stream."""

    def __init__(self, broker: EmbeddedBroker, workdir: Path) -> None:
        self.client = LeanClient(broker.host, broker.port, "bench-lean")
        self._subscriber = _subscriber(broker, workdir, self.client)
        self._waiting: list[bytes] = []
        self._oldest = 0.0
        self._seq = 0

    def chunk(self, index: int, outputs: dict[str, Any], **more: Any) -> None:
        """One chunk of the stream, as the protocol has it; written per the send hold's rule."""
        fields = reply_envelope(
            request_id="lean", seq=self._seq, type="chunk", model="m", version=1, index=index
        )
        fields.update(more)
        fields["outputs"] = outputs
        self._seq += 1
        waiting = self._waiting
        waiting.append(self.client.publish_packet(TOPIC, encode_payload(fields), 1))
        now = time.perf_counter()
        if len(waiting) == 1:
            self._oldest = now
        first = self._seq == 1
        if first or len(waiting) >= HOLD_MAX_MESSAGES or now - self._oldest >= HOLD_MAX_S:
            self._write()

    def end(self) -> None:
        """The stream ended: what waits goes; the next chunk starts a new stream."""
        self._write()
        self._seq = 0

    def _write(self) -> None:
        if self._waiting:
            self.client.sock.sendall(b"".join(self._waiting))
            self._waiting.clear()
            self.client.read(0)  # the acknowledgements already there

    def close(self) -> None:
        self.client.close()
        self._subscriber.terminate()
        self._subscriber.wait(10)


def _subscriber(
    broker: EmbeddedBroker, workdir: Path, client: LeanClient
) -> subprocess.Popen[bytes]:
    """`mosquitto_sub` at QoS 1 writing to a file, once a probe through the broker reached it."""
    out = workdir / "lean-sub.txt"
    command = ["mosquitto_sub", "-h", broker.host, "-p", str(broker.port), "-t", TOPIC]
    command += ["-q", "1", "-F", "%U", "--nodelay"]  # a receive time a message, as the agent's rows
    with out.open("wb") as sink:
        sub = subprocess.Popen(command, stdout=sink, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not out.stat().st_size:
        if time.monotonic() > deadline or sub.poll() is not None:
            sub.kill()
            raise RuntimeError("mosquitto_sub did not subscribe for the lean loop")
        client.sock.sendall(client.publish_packet(TOPIC, b"probe", 0))
        time.sleep(0.05)
    return sub


def alternate(
    bare: Callable[[], float], lean: Callable[[], float], rounds: int
) -> tuple[float, float, float]:
    """(bare rate, lean rate, median of the rounds' lean / mean of the bare runs around it);
    each warmed once first."""
    bare()
    lean()
    bare_rates, lean_rates, ratios = [], [], []
    before = bare()
    for _ in range(rounds):
        rate = lean()
        after = bare()
        bare_rates.append(after)
        lean_rates.append(rate)
        ratios.append(rate / ((before + after) / 2))
        before = after
    med = statistics.median
    return med(bare_rates), med(lean_rates), med(ratios)
