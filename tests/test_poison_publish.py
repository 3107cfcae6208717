"""A message the broker refuses, or that kills the connection, is quarantined, never retried
forever: one poison in the spool must not keep a box offline."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from agent.client import AgentClient
from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.spool import Spool
from agent.demo.broker import EmbeddedBroker
from agent.mqtt import poison
from agent.mqtt.window import Window
from agent.service.agent import Agent
from tests.conftest import agent_config

POISON = "edge/x\x01y"  # Mosquitto drops the connection: a malformed packet


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    made: list[Agent] = []
    yield made
    for agent in made:
        agent.stop()


def _spool_with(path: Path, messages: list[tuple[str, bytes]]) -> list[int]:
    """QoS 1 messages written straight into the spool an agent will open (as an old agent,
    or an older version without topic checks, would have left them)."""
    spool = Spool(path, max_bytes=1 << 26, max_messages=100_000)
    try:
        return [
            spool.add(f"old/{n}", topic, payload, 1, False, None)[0]
            for n, (topic, payload) in enumerate(messages)
        ]
    finally:
        spool.close()


def _events(
    broker: EmbeddedBroker, device: str, topic: str | None = None
) -> tuple[AgentClient, queue.Queue[dict[str, Any]], queue.Queue[bytes]]:
    """A client listening on the device's events (and on `topic`) before the agent starts."""
    client = AgentClient(broker.host, broker.port, device_id=device).connect()
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    client.listen(f"edge/{device}/events", lambda t, m, raw: got.put(m or {}))
    payloads: queue.Queue[bytes] = queue.Queue()
    if topic is not None:
        client.listen(topic, lambda t, m, raw: payloads.put(raw))
    return client, got, payloads


def _started(agents: list[Agent], config: Any) -> Agent:
    agent = Agent(config)
    agents.append(agent)
    agent.start()
    return agent


def _wait_event(events: queue.Queue[dict[str, Any]], kind: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            event = events.get(timeout=0.2)
        except queue.Empty:
            continue
        if event.get("type") == kind:
            return event
    raise AssertionError(f"no {kind} event within {timeout} s")


def _answered(client: AgentClient) -> int:
    reply = client.request(
        "decoder", {"token": np.array([[1]], dtype=np.int64)}, params={"max_steps": 3}, timeout=10
    )
    return len(list(reply))


def test_a_poison_topic_in_the_spool_is_quarantined_and_the_box_stays_online(
    broker, repository, tmp_path, paho_kind, agents
):
    config = agent_config(tmp_path, broker, repository)
    assert config.spool.path is not None
    good_topic = f"{config.root_topic}/result/decoder/old-good"
    poison_id, good_id = _spool_with(config.spool.path, [(POISON, b"poison"), (good_topic, b"ok")])
    client, events, good = _events(broker, config.device_id, good_topic)
    try:
        agent = _started(agents, config)
        assert agent.wait_ready(10)
        assert agent.transport.fast_path is (paho_kind == "fast")
        event = _wait_event(events, "publish_refused", 10)
        assert event["topic"] == POISON and "control character" in event["reason"]
        assert good.get(timeout=10) == b"ok"  # what comes after the poison still goes out
        deadline = time.monotonic() + 3  # a few seconds of serving: never a reconnect
        while time.monotonic() < deadline:
            assert _answered(client) == 3
            time.sleep(0.2)
        assert agent.transport.reconnects == 0
        assert agent.counters["messages_quarantined"] == 1
        assert agent.transport.quarantined == 1
        assert agent.outbox.flush_acks()
        assert agent.spool is not None
        assert agent.spool.load([poison_id, good_id]) == agent.spool.load([good_id])
        assert not agent.spool.load([poison_id])  # gone: not after a restart, nor as a resend
    finally:
        client.close()


def test_an_unknown_poison_is_quarantined_after_two_lost_connections(
    broker, repository, tmp_path, paho_kind, agents, monkeypatch
):
    """A message that drops the connection though no check knows it (here: the topic check
    switched off) is a suspect once in flight at a loss, and the poison once alone in flight
    at two more."""
    monkeypatch.setattr(poison, "topic_problem", lambda topic: None)
    config = agent_config(
        tmp_path, broker, repository, MQTT__RECONNECT_MIN_S="0.05", MQTT__RECONNECT_MAX_S="0.2"
    )
    assert config.spool.path is not None
    (poison_id,) = _spool_with(config.spool.path, [(POISON, b"poison")])
    client, events, _ = _events(broker, config.device_id)
    try:
        agent = _started(agents, config)
        event = _wait_event(events, "publish_refused", 20)
        assert event["topic"] == POISON and "lost connections" in event["reason"]
        assert agent.wait_ready(10)
        reconnects = agent.transport.reconnects
        assert reconnects == 1 + poison.ALONE_LOSSES
        assert _answered(client) == 3
        time.sleep(1.0)
        assert agent.transport.reconnects == reconnects  # the loop is over
        assert agent.counters["messages_quarantined"] == 1
        assert agent.outbox.flush_acks()
        assert agent.spool is not None and not agent.spool.load([poison_id])
    finally:
        client.close()


def _window_with(message: OutMessage) -> tuple[Window, Outbox, list[tuple[str, str, bool]]]:
    outbox = Outbox(100)
    window = Window(10, outbox)
    refused: list[tuple[str, str, bool]] = []
    window.quarantine.on_refused = lambda topic, reason, first: refused.append(
        (topic, reason, first)
    )
    window.pending[7] = (time.monotonic(), message)
    return window, outbox, refused


def test_a_permanent_refusal_is_quarantined_and_a_transient_one_is_kept(tmp_path):
    message = OutMessage("edge/d/result/m/r", b"x", 1, stream="m/r")
    window, _, refused = _window_with(message)
    window.acknowledged(7, ReasonCode(PacketTypes.PUBACK, identifier=0x90))  # topic name invalid
    assert window.quarantine.count == 1 and window.publish_failures == 1
    assert refused and refused[0][0] == "edge/d/result/m/r" and "0x90" in refused[0][1]

    window, _, refused = _window_with(message)
    window.acknowledged(7, ReasonCode(PacketTypes.PUBACK, identifier=0x97))  # quota exceeded
    assert window.quarantine.count == 0 and window.publish_failures == 1 and not refused
    assert window.acked == 0  # not acknowledged: it stays pending, published after a reconnect


def test_a_quarantined_spooled_message_leaves_the_spool(tmp_path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=1 << 24, max_messages=1000)
    outbox = Outbox(100, spool=spool)
    outbox.start()
    try:
        window = Window(10, outbox)
        bad = OutMessage(POISON, b"p", 1, stream="s/1")
        outbox.put(bad)
        outbox.put(OutMessage("edge/ok", b"g", 1, stream="s/2"))
        taken = outbox.take(10)
        assert window.quarantine.refuses(taken[0]) and not window.quarantine.refuses(taken[1])
        assert outbox.flush_acks()
        assert spool.count == 1 and not spool.load([bad.spool_id or 0])
    finally:
        outbox.close()
        spool.close()


CLOSED = (0x80, "Unspecified error")  # paho's reason for a socket the broker closed
PUBACK = ReasonCode(PacketTypes.PUBACK, "Success")


def test_a_suspect_is_convicted_only_alone_in_flight_and_cleared_by_its_acknowledgement():
    quarantine = poison.Quarantine(lambda spool_id: None)
    first = OutMessage("a/b", b"", 1, spool_id=5)
    later = OutMessage("a/b", b"", 1, spool_id=6)
    quarantine.connection_lost([later, first], *CLOSED)
    assert quarantine.suspects == {5: 0, 6: 0}
    quarantine.connection_lost([first, later], *CLOSED)  # not alone: not judged
    assert quarantine.count == 0 and quarantine.suspects == {5: 0, 6: 0}
    quarantine.connection_lost([first], *CLOSED)  # out alone, once
    quarantine.acknowledged(first)  # acknowledged on the next connection: no suspect
    assert quarantine.suspects == {6: 0}
    quarantine.connection_lost([first], *CLOSED)  # in flight at a loss: a suspect again
    quarantine.connection_lost([], *CLOSED)  # a loss with nothing in flight
    assert not quarantine.suspects
    quarantine.connection_lost([first], *CLOSED)
    quarantine.connection_lost([first], *CLOSED)
    assert quarantine.count == 0
    quarantine.connection_lost([first], 0x81, "Malformed packet")  # alone at a second loss
    assert quarantine.count == 1 and not quarantine.suspects


@pytest.mark.parametrize(
    "code, reason",
    [(0x8D, "Keep alive timeout"), (0x8E, "Session taken over"), (0x8B, "Server shutting down")],
)
def test_a_loss_no_message_can_cause_makes_no_suspect(code, reason):
    quarantine = poison.Quarantine(lambda spool_id: None)
    message = OutMessage("a/b", b"", 1, spool_id=5)
    for _ in range(3):
        quarantine.connection_lost([message], code, reason)
    assert quarantine.count == 0 and not quarantine.suspects
    quarantine.connection_lost([message], *CLOSED)
    quarantine.connection_lost([message], code, reason)  # the link, not the message
    assert quarantine.count == 0 and quarantine.suspects == {5: 0}


class _Wire:
    """The paho client's part the window uses: every publish succeeds, mids count up."""

    def __init__(self) -> None:
        self.published: list[bytes] = []

    def want_write(self) -> bool:
        return False

    def publish_fast(
        self, topic: str, payload: bytes, qos: int, retain: bool, properties: Any
    ) -> tuple[Any, int]:
        from paho.mqtt.enums import MQTTErrorCode

        self.published.append(payload)
        return MQTTErrorCode.MQTT_ERR_SUCCESS, len(self.published)


def test_a_suspect_goes_out_alone_after_the_messages_before_it():
    outbox = Outbox(100)
    window = Window(10, outbox)
    wire = _Wire()
    for n in range(4):
        outbox.put(OutMessage("a/b", b"%d" % n, 1, spool_id=10 + n))
    window.quarantine.suspects[12] = 0
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"0", b"1"] and window.full()  # the suspect waits for them
    window.acknowledged(1, PUBACK)
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"0", b"1"]
    window.acknowledged(2, PUBACK)
    assert not window.full()
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"0", b"1", b"2"] and window.full()  # alone
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"0", b"1", b"2"]
    window.acknowledged(3, PUBACK)
    assert not window.quarantine.suspects and not window.full()
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"0", b"1", b"2", b"3"]


def test_only_the_poison_is_quarantined_when_innocent_messages_are_in_flight_before_it(
    broker, repository, tmp_path, paho_kind, agents, monkeypatch
):
    """Mosquitto closes the connection at the poison with the acknowledgements of the messages
    before it possibly unread: each of those is a suspect in turn, and goes out alone, so only
    the poison is convicted and every message before and after it arrives."""
    monkeypatch.setattr(poison, "topic_problem", lambda topic: None)
    config = agent_config(
        tmp_path, broker, repository, MQTT__RECONNECT_MIN_S="0.05", MQTT__RECONNECT_MAX_S="0.2"
    )
    assert config.spool.path is not None
    good_topic = f"{config.root_topic}/result/decoder/before"
    sent = [(good_topic, b"%d" % n) for n in range(40)]
    sent += [(POISON, b"poison")] + [(good_topic, b"%d" % n) for n in range(40, 80)]
    _spool_with(config.spool.path, sent)
    client, events, good = _events(broker, config.device_id, good_topic)
    try:
        agent = _started(agents, config)
        event = _wait_event(events, "publish_refused", 60)
        assert event["topic"] == POISON and "lost connections" in event["reason"]
        assert agent.wait_ready(10)
        received: set[bytes] = set()
        deadline = time.monotonic() + 20
        while len(received) < 80 and time.monotonic() < deadline:
            try:
                received.add(good.get(timeout=0.5))
            except queue.Empty:
                continue
        assert received == {b"%d" % n for n in range(80)}
        assert agent.counters["messages_quarantined"] == 1
        assert agent.transport.reconnects == 1 + poison.ALONE_LOSSES  # one round finds it
    finally:
        client.close()


def test_a_resend_copy_of_a_suspect_is_judged_as_the_stored_message():
    """A subscriber's resend asks may send a suspect's copy before the spool reads the stored
    message back: the copy goes out alone, counts against it and clears it when acknowledged,
    so asking cannot put off the poison's quarantine (nor wipe the suspects)."""
    forgotten: list[int] = []
    quarantine = poison.Quarantine(forgotten.append)
    stored = OutMessage("a/b", b"p", 1, spool_id=5)
    copy = OutMessage("a/b", b"p", 1, copy_of=5)
    quarantine.connection_lost([stored, OutMessage("a/b", b"", 1, spool_id=6)], *CLOSED)
    quarantine.connection_lost([copy], *CLOSED)
    assert quarantine.suspects == {5: 1, 6: 0}
    quarantine.connection_lost([copy], *CLOSED)
    assert quarantine.count == 1 and forgotten == [5] and quarantine.suspects == {6: 0}

    outbox = Outbox(100)
    window = Window(10, outbox)
    wire = _Wire()
    window.quarantine.suspects[7] = 0
    outbox.put(OutMessage("a/b", b"live", 1, spool_id=8))
    outbox.put_background(OutMessage("a/b", b"copy", 1, copy_of=7))
    window.publish_batch(wire)  # type: ignore[arg-type]
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"live"] and window.full()  # the copy waits to go out alone
    window.acknowledged(1, PUBACK)
    window.publish_batch(wire)  # type: ignore[arg-type]
    assert wire.published == [b"live", b"copy"] and window.full()
    window.acknowledged(2, PUBACK)
    assert not window.quarantine.suspects and not window.full()
