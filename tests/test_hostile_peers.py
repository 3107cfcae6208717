"""A requester with publish rights on one device's request topics, written as the attacks:
a poison reply topic, relays onto other devices' and the agent's own topics, retained
requests, and an id that is already in use. Each against a real Mosquitto and agent."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.protocol.errors import Limits
from agent.protocol.payload import decode_payload, encode_payload
from agent.protocol.topics import ReplyTopics, topic_problem
from agent.service.agent import Agent
from agent.service.announce import BAD_REQUEST_REPORT_S
from tests.conftest import agent_config, write_long_decoder
from tests.ops_helpers import wait_until

TOKEN = np.array([[1]], dtype=np.int64)


def _request(request_id: str, **extra: Any) -> bytes:
    body = {"id": request_id, "inputs": {"token": TOKEN}, "params": {"max_steps": 2}, **extra}
    return encode_payload(body)


class _Everything:
    """A subscriber to `#`: every message the broker routes, by topic."""

    def __init__(self, broker: EmbeddedBroker, protocol: int = mqtt.MQTTv5) -> None:
        self.messages: queue.Queue[tuple[str, bytes, bool]] = queue.Queue()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=protocol)
        self._client.on_message = lambda c, u, m: self.messages.put(
            (m.topic, bytes(m.payload), bool(m.retain))
        )
        subscribed = threading.Event()
        self._client.on_subscribe = lambda *args: subscribed.set()
        self._client.connect(broker.host, broker.port)
        self._client.loop_start()
        self._client.subscribe("#", 1)
        assert subscribed.wait(5)

    def until(self, topic: str, timeout: float = 10.0) -> list[tuple[str, dict[str, Any]]]:
        """Every message (topic, decoded) up to and including the first one on `topic`."""
        seen: list[tuple[str, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                got, payload, retained = self.messages.get(timeout=0.1)
            except queue.Empty:
                continue
            if retained:
                continue  # held from before this test (other agents' status and inventory)
            try:
                decoded = decode_payload(payload, Limits())
            except Exception:
                decoded = {}
            seen.append((got, decoded))
            if got == topic:
                return seen
        raise AssertionError(f"nothing on {topic!r} within {timeout} s; saw {seen[-5:]}")

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@pytest.fixture
def everything(broker: EmbeddedBroker) -> Any:
    watcher = _Everything(broker)
    yield watcher
    watcher.close()


def _agent_published(agent: Agent, seen: list[tuple[str, dict[str, Any]]]) -> set[str]:
    """Topics of the agent's own messages in `seen` (requests are the test's)."""
    root = agent.root
    return {
        topic for topic, _ in seen if not topic.startswith((f"{root}/infer/", f"{root}/resend"))
    }


# -------------------------------------------------------------------- the topic validator


@pytest.mark.parametrize(
    "topic",
    [
        "edge/x\x01y",
        "edge/x\x7fy",
        "edge/x\x85y",
        "edge/x\x00y",
        "edge/x\ufffey",
        "edge/#",
        "edge/+/x",
        "edge//x",
        "edge/../x",
        "edge/./x",
        "/edge/x",
        "edge/x/",
        "",
        "e" * 257,
        7,
    ],
)
def test_topic_problem_refuses_what_a_broker_refuses_or_a_path_misreads(topic: object) -> None:
    assert topic_problem(topic) is not None


def test_reply_topics_default_to_the_devices_own_result_tree() -> None:
    rule = ReplyTopics.of(ReplyTopics.default_prefixes("edge/a"), "edge/a")
    assert rule.problem("edge/a/result/m/id-1") is None
    assert rule.problem("edge/a/result/backend/x.y-z") is None
    for relay in (
        "edge/b/result/m/victim",
        "edge/b/infer/m",
        "edge/a/status",
        "edge/a/infer/m",
        "edge/a/resend",
        "edge/a/result/../status",
        "edge/a",
    ):
        assert rule.problem(relay) is not None, relay
    # Widened by the operator: other trees are allowed, the agent's own topics still are not.
    wide = ReplyTopics.of(["edge/"], "edge/a")
    assert wide.problem("edge/backend/replies") is None
    assert wide.problem("edge/a/models") is not None
    assert wide.problem("edge/a/result/m/1") is None


# --------------------------------------------------------------------- attacks, end to end


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_poison_reply_to_is_refused_and_the_box_stays_online(
    broker, tmp_path, make_client, protocol
):
    """`reply_to` with a control character made Mosquitto drop the agent's connection for
    good (the QoS 1 reply was published again after every reconnect and restart)."""
    repository = write_long_decoder(tmp_path / "models", max_steps=8)
    config = agent_config(tmp_path, broker, repository, MQTT__PROTOCOL=f'"{protocol}"')
    for attempt in range(2):  # and again after a restart on the same state
        agent = Agent(config)
        agent.start()
        try:
            assert agent.wait_ready(10)
            client = make_client(broker, agent, protocol)
            for n, char in enumerate(("\x01", "\x7f", "\x85", "\u2028\x1b")):
                poison = f"{agent.root}/result/x{char}y"
                error = _answer(client, agent, f"poison-{attempt}-{n}", reply_to=poison)
                assert error["type"] == "error" and error["code"] == "bad_request"
                assert "reply_to" in error["message"]
            good = client.request("decoder", {"token": TOKEN}, params={"max_steps": 3}, qos=1)
            assert len(list(good)) == 3
            assert agent.transport.reconnects == 0
        finally:
            agent.stop()


def test_relays_onto_other_devices_and_the_agents_own_topics_are_refused(
    broker, repository, make_agent, make_client, everything
):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    root, prefix = agent.root, agent.config.mqtt.topic_prefix
    targets = [
        f"{prefix}/other-box/infer/decoder",
        f"{prefix}/other-box/result/decoder/victim-id",
        f"{root}/status",
        f"{root}/models",
        f"{root}/resend",
        f"{root}/infer/decoder",
        f"{root}/result/../status",
        f"{prefix}//x",
        f"{prefix}/../x",
    ]
    infer = f"{root}/infer/decoder"
    for n, target in enumerate(targets):
        client.publish_raw(infer, _request(f"relay-{n}", reply_to=target))
        props = client.response_properties(target, b"c")
        client.publish_raw(infer, _request(f"relay-rt-{n}"), 1, props)  # MQTT 5 Response Topic
    # A resend's `gone` may not be relayed either.
    resend = {"id": "relay-gone", "from_seq": 0, "reply_to": f"{prefix}/other-box/result/x"}
    client.publish_raw(f"{root}/resend", encode_payload(resend))
    client.publish_raw(infer, _request("last"))
    seen = everything.until(f"{root}/result/decoder/last")
    errors = {
        decoded["id"]: decoded
        for topic, decoded in seen
        if topic.startswith(f"{root}/result/decoder/relay") and decoded.get("type") == "error"
    }
    expected = {f"relay-{n}" for n in range(len(targets))} | {
        f"relay-rt-{n}" for n in range(len(targets))
    }
    assert set(errors) == expected
    assert all(e["code"] == "bad_request" and "reply_to" in e["message"] for e in errors.values())
    published = _agent_published(agent, seen)
    allowed = (f"{root}/result/", f"{root}/events", f"{root}/status", f"{root}/models")
    assert all(topic.startswith(allowed) for topic in published), sorted(published)
    relayed = [
        topic
        for topic, decoded in seen
        if "type" in decoded  # a reply, not one of the test's requests
        and str(decoded.get("id", "")).startswith("relay")
        and not topic.startswith(f"{root}/result/")
    ]
    assert relayed == []


def test_a_wider_reply_prefix_is_the_operators_explicit_choice(
    broker, repository, make_agent, make_client
):
    toml = '[mqtt]\nallowed_reply_prefixes = ["edge/backend-7/"]'
    agent = make_agent(broker, repository, toml=toml)
    client = make_client(broker, agent)
    reply = client.request(
        "decoder", {"token": TOKEN}, reply_to="edge/backend-7/replies", params={"max_steps": 2}
    )
    assert len(list(reply)) == 2
    error = _answer(client, agent, "own-topic", reply_to=f"{agent.root}/models")
    assert error["code"] == "bad_request" and "own topics" in error["message"]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_retained_requests_never_run(own_broker, tmp_path, make_client, protocol):
    """A retained request (or resend) was answered on every start and every reconnect."""
    repository = write_long_decoder(tmp_path / "models", max_steps=8)
    config = agent_config(tmp_path, own_broker, repository, MQTT__PROTOCOL=f'"{protocol}"')
    root = config.root_topic
    reply_topic = f"{root}/result/decoder/retained"
    publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    publisher.connect(own_broker.host, own_broker.port)
    publisher.loop_start()
    body = _request("retained", reply_to=reply_topic)
    publisher.publish(f"{root}/infer/decoder", body, 1, retain=True).wait_for_publish(5)
    resend = encode_payload({"id": "retained", "from_seq": 0, "model": "decoder"})
    publisher.publish(f"{root}/resend", resend, 1, retain=True).wait_for_publish(5)
    publisher.disconnect()
    publisher.loop_stop()

    agent = Agent(config)
    agent.start()
    try:
        assert agent.wait_ready(10)
        client = make_client(own_broker, agent, protocol)
        answers: queue.Queue[str] = queue.Queue()
        client.listen(reply_topic, lambda t, m, raw: answers.put(t))
        for round_ in range(2):  # at start, then after a reconnect
            good = client.request("decoder", {"token": TOKEN}, params={"max_steps": 2}, qos=1)
            assert len(list(good)) == 2
            assert answers.empty(), "a retained request was run"
            if round_ == 0:
                own_broker.restart()
                client.close()
                assert wait_until(lambda: agent.transport.reconnects >= 1, 15)
                assert wait_until(lambda: agent.transport.connected.is_set(), 15)
                client = make_client(own_broker, agent, protocol)
                client.listen(reply_topic, lambda t, m, raw: answers.put(t))
        counters = agent.telemetry()["counters"]
        assert counters.get("requests_received", 0) == 2  # the two good ones only
        if protocol == "3.1.1":  # MQTT 5's Retain Handling 2 keeps them at the broker
            assert counters.get("retained_ignored", 0) >= 2
    finally:
        agent.stop()


def test_an_id_in_use_is_refused_beside_the_running_stream(
    broker, tmp_path, make_agent, make_client
):
    """A second request with the id of a running one is refused without touching the running
    stream: on that stream's own topic an error would be taken for its terminal message, so
    the refusal is reported on `ROOT/events`; a duplicate naming another reply topic gets
    its error (`seq` null) there.

    The first stream is long (it must still run when its id comes again: a 400-step one could
    end first, and a finished id's duplicate is dropped as a redelivery) and is cancelled once
    the refusals are in."""
    steps = 100_000
    repository = write_long_decoder(tmp_path / "models", max_steps=steps)
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(f"{agent.root}/events", lambda t, m, raw: events.put(m or {}))
    on_topic: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(f"{agent.root}/result/decoder/same-id", lambda t, m, raw: on_topic.put(m or {}))
    elsewhere: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(f"{agent.root}/result/mine", lambda t, m, raw: elsewhere.put(m or {}))
    time.sleep(0.1)  # the subscriptions are in place
    first = client.request(
        "decoder", {"token": TOKEN}, request_id="same-id", params={"max_steps": steps}, qos=1
    )
    chunks = iter(first)
    next(chunks)  # it runs
    # QoS 1 (stored) and QoS 0 (not stored, yet the agent knows the id runs): both refused
    for qos in (1, 0):
        client.publish_raw(f"{agent.root}/infer/decoder", _request("same-id"), qos)
        event = events.get(timeout=10)
        while event.get("type") != "bad_request":
            event = events.get(timeout=10)
        assert "same-id" in event["reason"] and "in use" in event["reason"]
    reply_to = f"{agent.root}/result/mine"
    client.publish_raw(f"{agent.root}/infer/decoder", _request("same-id", reply_to=reply_to), 1)
    refusal = elsewhere.get(timeout=10)
    assert refusal["type"] == "error" and refusal["seq"] is None
    assert refusal["code"] == "bad_request" and "in use" in refusal["message"]
    client.cancel("same-id")
    rest = list(chunks)  # the running stream went on untouched until it was cancelled
    assert first.end is not None and first.end.finish_reason == "cancelled"
    assert first.end.chunks == 1 + len(rest) < steps
    seen = []
    while not on_topic.empty():
        seen.append(on_topic.get())
    assert [m["type"] for m in seen if m.get("seq") is None] == []  # no refusal on its topic
    assert seen[-1]["type"] == "end"

    # A QoS 1 request whose id names a running QoS 0 one (which the spool never stored):
    # refused too, before it is stored.
    quiet = client.request(
        "decoder", {"token": TOKEN}, request_id="quiet-id", params={"max_steps": steps}, qos=0
    )
    quiet_chunks = iter(quiet)
    next(quiet_chunks)
    time.sleep(BAD_REQUEST_REPORT_S)  # the events of the first part are reported
    client.publish_raw(f"{agent.root}/infer/decoder", _request("quiet-id"), 1)
    event = events.get(timeout=10)
    while event.get("type") != "bad_request" or "quiet-id" not in event["reason"]:
        event = events.get(timeout=10)
    assert "in use" in event["reason"]
    client.cancel("quiet-id")
    list(quiet_chunks)
    assert quiet.end is not None and quiet.end.finish_reason == "cancelled"


def _answer(client: AgentClient, agent: Agent, request_id: str, **extra: Any) -> dict[str, Any]:
    """The first message on the default reply topic of a request published as given."""
    messages: queue.Queue[dict[str, Any]] = queue.Queue()
    topic = f"{agent.root}/result/decoder/{request_id}"
    client.listen(topic, lambda t, m, raw: messages.put(m or {}))
    time.sleep(0.1)  # the subscription is in place before the request
    client.publish_raw(f"{agent.root}/infer/decoder", _request(request_id, **extra), 1)
    return messages.get(timeout=10)
