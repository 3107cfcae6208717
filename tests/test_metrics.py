"""The Prometheus endpoint scraped over HTTP while requests run; telemetry; the health check."""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
import urllib.error
import uuid

import numpy as np
import pytest

from agent.client import AgentError
from agent.ops.metrics import SAFETY_COUNTERS, AgentMetrics, Gauges
from agent.protocol.payload import encode_payload
from agent.service.agent import Agent
from tests.conftest import agent_config
from tests.ops_helpers import sample, scrape, wait_until


@pytest.fixture
def metered(tmp_path, broker, repository):
    """An agent with its metrics endpoint on a free port."""
    agents: list[Agent] = []

    def make(**env: str) -> Agent:
        config = agent_config(tmp_path, broker, repository, METRICS__PORT="0", **env)
        agent = Agent(config)
        agents.append(agent)
        agent.start()
        assert agent.wait_ready(10)
        return agent

    yield make
    for agent in agents:
        agent.stop()


def _url(agent: Agent, path: str = "/metrics") -> str:
    assert agent.metrics_server is not None
    return agent.metrics_server.url + path


def test_counters_move_while_requests_run(metered, broker, make_client):
    agent = metered()
    client = make_client(broker, agent)
    before = scrape(_url(agent))
    assert sample(before, "edge_agent_requests_received_total") == 0
    ok = dict(model="decoder", version="1", outcome="ok")
    assert sample(before, "edge_agent_requests_total", **ok) is None
    assert (
        sample(
            before, "edge_agent_model_version_state", model="decoder", version="1", state="ready"
        )
        == 1
    )
    assert sample(before, "edge_agent_model_serving_version", model="decoder") == 1
    assert sample(before, "edge_agent_mqtt_connected") == 1
    assert sample(before, "edge_agent_healthy") == 1
    assert (sample(before, "edge_agent_process_resident_memory_bytes") or 0) > 10_000_000
    assert (sample(before, "edge_agent_model_load_seconds_count", model="decoder") or 0) == 1

    token = np.array([[1]], dtype=np.int64)
    for _ in range(5):
        chunks = list(client.request("decoder", {"token": token}, params={"max_steps": 4}))
        assert len(chunks) == 4
    with pytest.raises(AgentError):
        list(client.request("nosuch", {"token": token}, timeout=5))
    x = np.zeros((8, 16), dtype=np.float32)
    assert client.infer("mlp", {"x": x}, stream=False)["y"].shape[0] == 8

    def moved() -> bool:
        text = scrape(_url(agent))
        return (
            sample(text, "edge_agent_requests_total", **ok) == 5
            and (sample(text, "edge_agent_publish_ack_seconds_count") or 0) >= 5 * 5
        )

    assert wait_until(moved, 5)
    after = scrape(_url(agent))
    assert sample(after, "edge_agent_requests_received_total") == 7
    assert sample(after, "edge_agent_requests_total", model="mlp", version="1", outcome="ok") == 1
    # A model that does not exist is one bounded label, whatever the topic said.
    assert (
        sample(
            after,
            "edge_agent_requests_total",
            model="_unknown",
            version="none",
            outcome="unknown_model",
        )
        == 1
    )
    assert sample(after, "edge_agent_time_to_first_chunk_seconds_count", model="decoder") == 5
    assert sample(after, "edge_agent_request_duration_seconds_count", model="decoder") == 5
    assert sample(after, "edge_agent_inference_seconds_count", model="mlp") == 1
    assert (sample(after, "edge_agent_queue_seconds_sum", model="decoder") or 0) >= 0
    assert sample(after, "edge_agent_chunks_published_total", model="decoder") == 20
    # 5 x (4 chunks + end) + the unknown_model error + one result
    assert sample(after, "edge_agent_reply_messages_published_total") == 27
    assert (sample(after, "edge_agent_reply_bytes_published_total") or 0) > 27 * 50
    assert sample(after, "edge_agent_queue_depth") == 0
    assert sample(after, "edge_agent_inflight_requests") == 0
    assert sample(after, "edge_agent_mqtt_reconnects_total") == 0
    assert sample(after, "edge_agent_spool_messages") is not None
    assert 'edge_agent_info{device="' in after


def test_healthz_and_the_server_thread(metered):
    agent = metered()
    body = json.loads(scrape(_url(agent, "/healthz")))
    assert body["ok"] is True and body["connected"] is True
    assert "serving 3 of 3" in body["status"]
    with pytest.raises(urllib.error.HTTPError) as e:
        scrape(_url(agent, "/nothing"))
    assert e.value.code == 404
    assert any(t.name == "metrics-http" for t in threading.enumerate())
    agent.stop()
    assert not any(t.name == "metrics-http" and t.is_alive() for t in threading.enumerate())


def test_making_an_agent_logs_no_error(tmp_path, broker, repository, caplog):
    """The gauges are read at scrape time only: not while the agent's parts are being made."""
    with caplog.at_level(logging.ERROR):
        agent = Agent(agent_config(tmp_path, broker, repository, METRICS__PORT="0"))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    agent.start()
    try:
        assert agent.wait_ready(10)
        assert wait_until(lambda: sample(scrape(_url(agent)), "edge_agent_mqtt_connected") == 1, 5)
    finally:
        agent.stop()


def test_a_port_in_use_costs_the_metrics_not_the_service(tmp_path, broker, repository, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = agent_config(tmp_path, broker, repository, METRICS__PORT=str(port))
        agent = Agent(config)
        with caplog.at_level(logging.ERROR, logger="agent.service.agent"):
            agent.start()
        try:
            assert agent.wait_ready(10)
            assert agent.metrics_server is None
            assert any("cannot listen" in r.getMessage() for r in caplog.records)
        finally:
            agent.stop()


def test_telemetry_carries_the_metrics_snapshot(metered, broker, make_client):
    agent = metered(TELEMETRY__INTERVAL_S="0.3")
    client = make_client(broker, agent)
    snapshots: queue.Queue[dict] = queue.Queue()
    client.listen(f"{agent.root}/telemetry", lambda t, m, raw: snapshots.put(m))
    x = np.zeros((4, 16), dtype=np.float32)
    client.infer("mlp", {"x": x})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        message = snapshots.get(timeout=2)
        metrics = message["metrics"]
        if metrics.get("edge_agent_requests_total", {}).get("model=mlp,outcome=ok,version=1") == 1:
            break
    else:
        pytest.fail("telemetry never showed the request")
    assert metrics["edge_agent_requests_received_total"] >= 1
    assert metrics["edge_agent_request_duration_seconds_count"]["model=mlp"] == 1
    assert metrics["edge_agent_process_resident_memory_bytes"] > 0
    assert message["gauges"]["queue_depth"] == 0
    assert len(encode_payload(message)) < 64 * 1024


def test_registries_are_per_agent_and_labels_bounded():
    known = {"decoder"}
    a = AgentMetrics(Gauges, device="a", version="0", known_model=known.__contains__)
    b = AgentMetrics(Gauges, device="b", version="0")
    for i in range(100):
        a.request_done(f"junk-{uuid.uuid4().hex}-{i}", None, "unknown_model")
    a.request_done("decoder", 3, "ok")
    snap = a.snapshot()
    assert snap["edge_agent_requests_total"] == {
        "model=_unknown,outcome=unknown_model,version=none": 100,
        "model=decoder,outcome=ok,version=3": 1,
    }
    assert "edge_agent_requests_total" not in b.snapshot()


def test_series_of_removed_models_and_versions_stop_being_exported():
    """Labels were added and never removed: every model name ever shipped, and every version
    ever swapped in, stayed in every scrape (96 series a removed model)."""
    known = {"kept", "gone"}
    metrics = AgentMetrics(Gauges, device="a", version="0", known_model=known.__contains__)
    for model, version in (("kept", 1), ("kept", 2), ("gone", 1)):
        metrics.request_done(model, version, "ok")
        metrics.request_timing(model, 0.001, 0.002, 0.003, 4)
        metrics.first_chunk_after(model, 0.001)
        metrics.model_loaded(model, 0.5)
    before = metrics.snapshot()
    assert set(before["edge_agent_requests_total"]) == {
        "model=kept,outcome=ok,version=1",
        "model=kept,outcome=ok,version=2",
        "model=gone,outcome=ok,version=1",
    }
    metrics.energy.set_power(5.0)
    token = metrics.energy.begin()
    metrics.energy.end(token, "gone", 0.01, 1)
    assert set(metrics.energy.snapshot()) == {"gone"}
    known.discard("gone")  # its folder removed, and kept's version 1 swapped out
    metrics.forget_gone({"models": {"kept": {"serving": 2, "versions": {"2": {}}}}})
    after = metrics.snapshot()
    assert set(after["edge_agent_requests_total"]) == {"model=kept,outcome=ok,version=2"}
    exported = "\n".join(
        line
        for family in metrics.registry.collect()
        for sample in family.samples
        for line in [f"{sample.name}{sample.labels}"]
    )
    assert "gone" not in exported and "kept" in exported
    assert metrics.energy.snapshot() == {}
    metrics.request_done("gone", 1, "ok")  # a late one
    assert "model=_unknown,outcome=ok,version=1" in metrics.snapshot()["edge_agent_requests_total"]


def test_the_grafana_dashboard_only_uses_metrics_that_exist():
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    dashboard = json.loads(
        (Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text()
    )
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    used = {
        re.sub(r"_(bucket|count|sum)$", "", n)
        for e in exprs
        for n in re.findall(r"edge_agent_\w+", e)
    }
    metrics = AgentMetrics(lambda: Gauges(spool_messages=0, spool_bytes=0), device="x", version="0")
    exposed = set(re.findall(r"^# TYPE (\w+) ", generate_latest(metrics.registry).decode(), re.M))
    assert used and used <= exposed, sorted(used - exposed)


def test_faults_handled_without_stopping_are_counters():
    """Each safety counter of the agent is a Prometheus counter, zero until it happens."""
    metrics = AgentMetrics(
        lambda: Gauges(counters={"broker_session_lost": 2, "retained_ignored": 1}),
        device="d",
        version="0",
    )
    snap = metrics.snapshot()
    assert snap["edge_agent_broker_session_lost_total"] == 2
    assert snap["edge_agent_retained_ignored_total"] == 1
    for name, _ in SAFETY_COUNTERS:
        assert f"edge_agent_{name}_total" in snap
