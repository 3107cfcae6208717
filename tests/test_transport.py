"""The connection under pressure: a broker that stops reading, a disk that fails for a while.

The agent reads and writes its socket in bulk and writes its spool from one thread (see
agent/mqtt/connection.py, agent/mqtt/paho_fast.py and agent/delivery/spool_writer.py); these
tests stall both and check that nothing is lost, reordered or buffered without bound.
"""

from __future__ import annotations

import signal
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.spool import Spool
from agent.demo import models as demo_models

WIDTH = 1 << 17  # float32: 512 KiB a reply, sent in parts
# 60 MiB in all: more than loopback TCP can hold while the broker does not read (a send
# buffer of up to 4 MiB, a receive window of up to half of tcp_rmem's 32 MiB, the outbox).
STEPS = 120


def repeater() -> onnx.ModelProto:
    """A steps model whose state comes back unchanged: every step emits the same 512 KiB."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["h_out"])],
        "repeater",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["batch", WIDTH])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


REPEATER_CONFIG = f"""\
[stream]
mode = "steps"
max_steps = {STEPS}
state = {{ h = "h_out" }}
emit = ["h_out"]
"""


def test_a_broker_that_stops_reading_costs_time_not_replies(
    own_broker, tmp_path, make_agent, make_client
):
    """QoS 0 has no in-flight window: with the broker stopped (SIGSTOP) mid-stream the
    socket fills, the agent keeps the rest in its outbox (bounded: the worker waits), and once
    the broker reads again every chunk arrives whole and in order."""
    repository = tmp_path / "models"
    (repository / "repeater" / "1").mkdir(parents=True)
    demo_models.save(repeater(), repository / "repeater" / "1" / "model.onnx")
    (repository / "repeater" / "config.toml").write_text(REPEATER_CONFIG)
    agent = make_agent(own_broker, repository, OUTBOX__MAX_MESSAGES="16")
    client = make_client(own_broker, agent)
    h = np.random.default_rng(7).standard_normal((1, WIDTH)).astype(np.float32)
    reply = client.request("repeater", {"h": h}, reply_qos=0, timeout=60)
    chunks = iter(reply)
    first = next(chunks)  # streaming: now stop the broker under it
    own_broker._process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        time.sleep(1.5)  # the agent goes on: its socket fills, then its outbox
        assert agent.transport.connected.is_set()
        assert len(agent.outbox) <= 16 + agent.config.outbox.error_reserve
        assert agent.transport.unsent_bytes < 16 * 130_000  # one write's worth, not the stream
        assert agent.scheduler.busy == 1  # the worker waits for room, it did not fail
    finally:
        own_broker._process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    rest = list(chunks)
    assert [c.index for c in [first, *rest]] == list(range(STEPS))
    for chunk in [first, *rest]:
        np.testing.assert_array_equal(chunk.outputs["h_out"], h)
    assert reply.duplicates == 0 and reply.end is not None
    assert agent.health_problem() is None


def test_the_spool_writer_retries_a_failing_disk_and_loses_nothing(tmp_path: Path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=10_000)
    failures = {"left": 3}
    write = spool.write

    def flaky(items, acks, protected_after):  # type: ignore[no-untyped-def]
        if failures["left"]:
            failures["left"] -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return write(items, acks, protected_after)

    spool.write = flaky  # type: ignore[method-assign]
    box = Outbox(64, spool=spool)
    box.start()
    try:
        for n in range(20):
            box.put(OutMessage("t/a", bytes([n]) * 10, 1, stream="a", rid="a", seq=n))
        assert box.flush_acks(timeout=10)
        assert failures["left"] == 0 and box.writer is not None and box.writer.failures == 3
        assert [m.payload[0] for m in spool.load_after(0, 100)] == list(range(20))
    finally:
        box.close()
        spool.close()


def test_a_producer_waiting_for_the_writer_wakes_it(tmp_path: Path):
    """Nothing else runs here: a producer blocked on the writer's backlog must wake it."""
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=10_000)
    box = Outbox(8, spool=spool)
    box.start()
    done = threading.Event()

    def produce() -> None:
        for _ in range(100):
            box.put(OutMessage("t/a", b"x", 1, stream="a"))
            box.get(0)  # published from memory; its acknowledgement never comes
        done.set()

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        assert done.wait(10)
        assert box.flush_acks(timeout=10) and spool.count == 100
    finally:
        thread.join(10)
        box.close()
        spool.close()
