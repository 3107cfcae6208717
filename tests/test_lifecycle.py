"""Start, stop and the messages around them: events, telemetry, draining, provider fallback."""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.config import load_config
from agent.demo import models as demo_models
from agent.protocol.payload import encode_payload
from agent.service import agent as agent_module
from agent.service.agent import Agent, intra_op_threads
from tests.conftest import agent_config


def _listen(client, topic: str) -> queue.Queue[dict]:
    messages: queue.Queue[dict] = queue.Queue()
    client.listen(topic, lambda t, m, raw: messages.put(m))
    return messages


def test_stop_answers_queued_requests_with_shutting_down(broker, repository, make_client, tmp_path):
    config = agent_config(
        tmp_path, broker, repository, SCHEDULER__WORKERS="1", SCHEDULER__DRAIN_TIMEOUT_S="5"
    )
    agent = Agent(config)
    agent.start()
    assert agent.wait_ready(10)
    client = make_client(broker, agent)
    replies = _listen(client, f"{agent.root}/result/mlp/+")
    # Large enough that the one worker cannot empty the queue between `depth` and `stop()`
    # (with 512 rows it did, now and then: every request answered `end`).
    x = np.random.default_rng(0).standard_normal((8192, 16)).astype(np.float32)
    for i in range(20):
        body = {"id": f"stop-{i}", "inputs": {"x": x}}
        client.publish_raw(f"{agent.root}/infer/mlp", encode_payload(body), qos=1)
    deadline = time.monotonic() + 5
    while agent.scheduler.depth < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    agent.stop()
    terminal: dict[str, dict] = {}
    deadline = time.monotonic() + 5
    while len(terminal) < 20 and time.monotonic() < deadline:
        try:
            message = replies.get(timeout=0.1)
        except queue.Empty:
            continue
        if message["type"] != "chunk":
            assert message["id"] not in terminal
            terminal[message["id"]] = message
    # Every request the agent took was answered exactly once; those it never took were
    # still on the broker (or refused) when it stopped.
    outcomes = {m.get("code", m["type"]) for m in terminal.values()}
    assert outcomes <= {"end", "shutting_down"}
    assert "shutting_down" in outcomes


def _stopped_while_running(
    agent: Agent, client: Any, model: str, inputs: dict[str, Any]
) -> list[dict[str, Any]]:
    """The replies to a request that runs when the agent is stopped, as they came."""
    replies = _listen(client, f"{agent.root}/result/{model}/long-1")
    body = {"id": "long-1", "inputs": inputs}
    client.publish_raw(f"{agent.root}/infer/{model}", encode_payload(body), qos=1)
    deadline = time.monotonic() + 5
    while agent.scheduler.busy == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    agent.stop()
    messages = []
    while True:
        try:
            messages.append(replies.get(timeout=1.0))
        except queue.Empty:
            return messages


def test_running_request_is_cancelled_after_the_drain_timeout(
    broker, repository, make_client, tmp_path
):
    config = agent_config(tmp_path, broker, repository, SCHEDULER__DRAIN_TIMEOUT_S="0")
    agent = Agent(config)
    agent.start()
    assert agent.wait_ready(10)
    x = np.random.default_rng(0).standard_normal((60_000, 16)).astype(np.float32)
    messages = _stopped_while_running(agent, make_client(broker, agent), "mlp", {"x": x})
    assert messages and messages[-1]["type"] == "error"
    assert messages[-1]["code"] == "shutting_down"
    assert sum(m["type"] == "error" for m in messages) == 1


def _slow_model(root: Path, steps: int = 600) -> Path:
    """x [n, 512] -> y: `steps` MatMuls of one 512 x 512 weight, in one run of the model
    (about a second on this machine): a run the drain cannot cut short."""
    weight = numpy_helper.from_array(np.eye(512, dtype=np.float32), "w")
    names = ["x", *[f"h{k}" for k in range(steps - 1)], "y"]
    nodes = [helper.make_node("MatMul", [a, "w"], [b]) for a, b in itertools.pairwise(names)]
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 512])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", demo_models.OPSET)])
    model.ir_version = demo_models.IR_VERSION
    (root / "slow" / "1").mkdir(parents=True)
    demo_models.save(model, root / "slow" / "1" / "model.onnx")
    return root


def test_a_run_longer_than_the_drain_and_its_grace_is_answered_before_the_agent_goes(
    broker, make_client, tmp_path, monkeypatch
):
    """One run of the model outlasts the drain and the grace after it: the request is
    answered `shutting_down` before the connection closes, once (it went unanswered, and a
    QoS 0 request was lost)."""
    monkeypatch.setattr(agent_module, "CANCEL_GRACE_S", 0.0)
    repository = _slow_model(tmp_path / "models")
    config = agent_config(tmp_path, broker, repository, SCHEDULER__DRAIN_TIMEOUT_S="0")
    agent = Agent(config)
    agent.start()
    assert agent.wait_ready(10)
    inputs = {"x": np.ones((256, 512), dtype=np.float32)}
    messages = _stopped_while_running(agent, make_client(broker, agent), "slow", inputs)
    assert [(m["type"], m.get("code")) for m in messages] == [("error", "shutting_down")]


def test_events_and_telemetry(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository, TELEMETRY__INTERVAL_S="0.5")
    client = make_client(broker, agent)
    telemetry = _listen(client, f"{agent.root}/telemetry")
    list(client.request("decoder", {"token": np.array([[1]], dtype=np.int64)}))
    snapshot = telemetry.get(timeout=3)
    if snapshot["counters"].get("requests_ok", 0) < 1:
        snapshot = telemetry.get(timeout=3)
    assert snapshot["counters"]["requests_ok"] >= 1
    assert {"queue_depth", "busy_workers", "outbox_depth", "reconnects"} <= set(snapshot["gauges"])
    assert isinstance(snapshot["ts"], int) and snapshot["epoch"] == agent.epoch


def test_load_events_reach_a_subscriber_that_was_waiting(broker, repository, make_client, tmp_path):
    config = agent_config(tmp_path, broker, repository)
    from agent.client import AgentClient

    with AgentClient(
        broker.host, broker.port, device_id=config.device_id, topic_prefix="edge"
    ) as watcher:
        events = _listen(watcher, f"edge/{config.device_id}/events")
        agent = Agent(config)
        agent.start()
        try:
            loaded = set()
            deadline = time.monotonic() + 5
            while len(loaded) < 3 and time.monotonic() < deadline:
                try:
                    event = events.get(timeout=0.2)
                except queue.Empty:
                    continue
                if event["type"] == "model_loaded":
                    assert event["version"] == 1 and event["backend"] == "onnxruntime"
                    assert event["providers"] == ["CPUExecutionProvider"]
                    loaded.add(event["model"])
            assert loaded == {"decoder", "mlp", "classifier"}
        finally:
            agent.stop()


def test_missing_provider_falls_back_and_reports_what_runs(
    broker, repository, make_agent, make_client
):
    agent = make_agent(
        broker, repository, MODELS__PROVIDERS='["CUDAExecutionProvider", "CPUExecutionProvider"]'
    )
    inventory = agent.models.inventory()["models"]["decoder"]["versions"]["1"]
    assert inventory["state"] == "ready"
    assert inventory["providers"] == ["CPUExecutionProvider"]


def test_intra_op_threads_fit_the_cores(tmp_path):
    import os

    cores = len(os.sched_getaffinity(0))
    config = load_config(None, {"EDGE_AGENT__SCHEDULER__WORKERS": "2"})
    assert intra_op_threads(config) == max(1, cores // 2)
    assert intra_op_threads(config) * config.scheduler.workers <= max(cores, 2)
    pinned = load_config(None, {"EDGE_AGENT__MODELS__INTRA_OP_THREADS": "3"})
    assert intra_op_threads(pinned) == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel thread names: Linux")
def test_the_agents_threads_carry_their_names_in_the_kernel(broker, repository, make_agent):
    """`top -H` and /proc show each thread's own name, not `python` for all of them."""
    agent = make_agent(broker, repository)
    wanted = {"mqtt-io", "spool-writer", "infer-worker-0", "model-watcher", "housekeeping"}
    python_names = {t.name for t in threading.enumerate()}
    assert wanted <= python_names  # the agent runs them (guards the test itself)
    kernel_names = {
        (task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()
    }
    assert wanted <= kernel_names, kernel_names
    # watchdog's threads (the repository's watcher), renamed once they run
    assert {"watcher-events", "watcher-emitter"} <= kernel_names, kernel_names
    if agent.watcher.backend != "PollingObserver":  # inotify: its descriptor's reader too
        assert "watcher-inotify" in kernel_names, kernel_names
        assert "model-watcher-inotify" in python_names
    if any(t.name == "model-watcher-inotify-parse" for t in threading.enumerate()):
        assert "watcher-parse" in kernel_names, kernel_names
    assert "InotifyFD-Dispatcher" not in {t.name for t in threading.enumerate()}


def test_housekeeping_outlives_a_spool_it_cannot_write(
    broker, repository, make_agent, make_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only or full disk made the spool's purge raise, which ended the housekeeping
    thread: no more telemetry, nor the systemd watchdog's pings (a restart loop)."""
    import sqlite3

    from agent.delivery.spool import Spool

    def read_only(self: Spool, *args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(Spool, "purge_acked", read_only)
    agent = make_agent(broker, repository, TELEMETRY__INTERVAL_S="0.2")
    client = make_client(broker, agent)
    telemetry: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(f"{agent.root}/telemetry", lambda t, m, raw: telemetry.put(m or {}))
    time.sleep(3)  # housekeeping ticks every 0.5 s here: a telemetry each tick
    assert agent.housekeeping._thread.is_alive()
    assert telemetry.qsize() >= 4
