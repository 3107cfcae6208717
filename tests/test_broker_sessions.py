"""The broker's session at every CONNACK, and what refused connections are told as."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.mqtt.reconnect import next_attempt
from agent.mqtt.session import Subscriptions, closed_early_text, refusal_text
from agent.protocol.errors import Limits
from agent.protocol.payload import decode_payload
from agent.service.agent import Agent
from tests.ops_helpers import wait_until

FAST_RECONNECT = {"MQTT__RECONNECT_MIN_S": "1.0", "MQTT__RECONNECT_MAX_S": "1.0"}


class EventWatcher:
    """Events of one device, by a client that reconnects faster than the agent."""

    def __init__(self, broker: EmbeddedBroker, root: str) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.reconnect_delay_set(0.05, 0.1)
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(f"{root}/events", 1)
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.events.append(decode_payload(message.payload, Limits()))

    def of_type(self, kind: str) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e.get("type") == kind]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_session_lost_by_the_broker_is_reported(
    own_broker: EmbeddedBroker,
    make_agent: Callable[..., Agent],
    repository: Path,
    protocol: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Mosquitto without persistence forgets every session when it restarts."""
    agent = make_agent(own_broker, repository, MQTT__PROTOCOL=f'"{protocol}"', **FAST_RECONNECT)
    assert agent.transport.sessions_lost == 0  # the first connection expects nothing
    own_broker.restart()
    watcher = EventWatcher(own_broker, agent.root)
    try:
        assert wait_until(lambda: bool(watcher.of_type("broker_session_lost")), 20)
        (event,) = watcher.of_type("broker_session_lost")
        assert isinstance(event["ts"], int)
        assert agent.transport.sessions_lost == 1
        assert agent.counters["broker_session_lost"] == 1
        assert "kept no session" in caplog.text
    finally:
        watcher.close()


def test_a_kept_session_is_not_reported(
    tmp_path: Path, make_agent: Callable[..., Agent], repository: Path
) -> None:
    """Mosquitto with persistence keeps the session across a clean restart."""
    broker = EmbeddedBroker(persistence=True, workdir=tmp_path / "broker")
    (tmp_path / "broker").mkdir()
    broker.start()
    try:
        agent = make_agent(broker, repository, **FAST_RECONNECT)
        broker.restart()
        assert wait_until(lambda: agent.transport.reconnects >= 1, 10)
        assert agent.transport.connected.wait(20)
        assert agent.transport.sessions_lost == 0
        assert agent.counters["broker_session_lost"] == 0
    finally:
        agent.stop()
        broker.close()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_the_agent_is_ready_once_the_broker_has_its_subscriptions(
    own_broker: EmbeddedBroker,
    make_agent: Callable[..., Agent],
    make_client: Callable[..., AgentClient],
    repository: Path,
    protocol: str,
) -> None:
    """Ready (`wait_ready`, the service's READY) means a request published now arrives: the
    broker acknowledged the agent's subscriptions, asked for again on every connection (a
    broker without persistence forgets them when it restarts)."""
    agent = make_agent(own_broker, repository, MQTT__PROTOCOL=f'"{protocol}"', **FAST_RECONNECT)
    assert agent.transport.subscribed.is_set()
    own_broker.stop()
    assert wait_until(lambda: not agent.transport.subscribed.is_set(), 10)
    assert not agent.wait_ready(0.2)
    own_broker.start()
    assert agent.wait_ready(20)
    client = make_client(own_broker, agent)
    reply = client.request("mlp", {"x": np.ones((2, 16), np.float32)}, stream=False, timeout=10)
    assert reply.collect()["y"].shape == (2, 8)


def test_a_subscription_the_broker_refuses_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Mosquitto grants a subscription its ACL denies (and then delivers nothing); brokers
    that refuse one in the SUBACK (MQTT 5 0x87) get it logged by topic."""
    subscriptions = Subscriptions([("edge/x/infer/+", 1), ("edge/x/cancel", 1)], mqtt5=True)
    assert not subscriptions.active.is_set()

    class Client:
        def subscribe(self, topics: object) -> tuple[int, int]:
            return mqtt.MQTT_ERR_SUCCESS, 7

    subscriptions.subscribe(Client())
    granted = ReasonCode(PacketTypes.SUBACK, identifier=1)
    refused = ReasonCode(PacketTypes.SUBACK, "Not authorized")
    subscriptions.acknowledged(None, None, 6, [granted, granted], None)
    assert not subscriptions.active.is_set()  # another packet's SUBACK
    subscriptions.acknowledged(None, None, 7, [refused, granted], None)
    assert subscriptions.active.is_set()
    assert "refused the subscription to edge/x/infer/+: Not authorized" in caplog.text
    assert "edge/x/cancel" not in caplog.text
    subscriptions.lost()
    assert not subscriptions.active.is_set()
    assert Subscriptions([], mqtt5=False).active.is_set()  # nothing to wait for


def test_unsupported_protocol_says_which_setting() -> None:
    refused = ReasonCode(PacketTypes.CONNACK, "Unsupported protocol version")
    text = refusal_text(refused, mqtt5=True)
    assert 'protocol = "3.1.1"' in text and "TLS" not in text
    other = ReasonCode(PacketTypes.CONNACK, "Not authorized")
    assert refusal_text(other, mqtt5=True) == "broker refused the connection: Not authorized"
    closed = closed_early_text(ReasonCode(PacketTypes.DISCONNECT, "Unspecified error"), True)
    assert "TLS client certificate" in closed and 'protocol = "3.1.1"' in closed
    assert "protocol" not in closed_early_text(ReasonCode(PacketTypes.DISCONNECT), False)


def test_backoff_keeps_growing_while_connections_end_at_once() -> None:
    attempt = 0
    for _ in range(5):  # accepted, then dropped within a second, five times
        attempt = next_attempt(attempt, lasted_s=0.2)
    assert attempt == 5
    assert next_attempt(attempt, lasted_s=120.0) == 0
