"""The MQTT connection (`agent.mqtt.connection.Transport`) against a real broker, with the
fast client and with paho's own (the fallback, forced by `EDGE_AGENT_PAHO=plain`): QoS 0/1/2
both ways, acknowledgements at once and deferred, the in-flight window; and the pieces of a
connection attempt (backoff, epoch)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.config import MqttConfig
from agent.delivery.outbox import Outbox, OutMessage
from agent.demo.broker import EmbeddedBroker
from agent.mqtt.connection import Transport
from agent.mqtt.epoch import EpochStore
from agent.mqtt.inbound import Inbound
from agent.mqtt.messages import Incoming
from agent.mqtt.reconnect import backoff_delays

BROKER_INFLIGHT = 10


def test_backoff_is_capped_and_jittered():
    delay = backoff_delays(0.5, 30.0, random.Random(1))
    samples = [delay(n) for n in range(12)]
    assert all(0.5 <= s <= 30.0 for s in samples)
    assert len({round(s, 3) for s in samples}) == len(samples)
    assert max(delay(40) for _ in range(200)) <= 30.0


def test_epoch_grows_and_survives_restart(tmp_path: Path):
    store = EpochStore(tmp_path / "epoch")
    assert store.next() == 1
    store.commit(store.next())
    store.commit(store.next())
    assert EpochStore(tmp_path / "epoch").value == 2


class Peer:
    """A plain paho client on the other side: subscribes to `topic/#`, records what comes."""

    def __init__(self, broker: EmbeddedBroker, topic: str) -> None:
        self.got: list[tuple[str, bytes, int]] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"peer-{topic[-8:]}")
        subscribed = threading.Event()
        self.client.on_message = self._record
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.on_connect = lambda c, *a: c.subscribe(f"{topic}/#", 2)
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert subscribed.wait(10)

    def _record(self, client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.got.append((message.topic, bytes(message.payload), message.qos))

    def wait_for(self, count: int, timeout: float = 10.0) -> list[tuple[str, bytes, int]]:
        deadline = time.monotonic() + timeout
        while len(self.got) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            return list(self.got)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    """A Mosquitto that sends a client at most 10 QoS 1/2 messages it has not acknowledged."""
    with EmbeddedBroker(extra_config=[f"max_inflight_messages {BROKER_INFLIGHT}"]) as b:
        yield b


@pytest.fixture
def transport(
    broker: EmbeddedBroker, tmp_path: Path, paho_kind: str
) -> Iterator[Callable[..., tuple[Transport, Outbox]]]:
    """`transport(on_message, subscriptions, **mqtt_settings)`: started and connected, with
    the outbox it publishes from."""
    made: list[Transport] = []

    def make(
        on_message: Callable[[Incoming], None] = lambda m: None,
        subscriptions: tuple[tuple[str, int], ...] = (),
        **settings: object,
    ) -> tuple[Transport, Outbox]:
        config = MqttConfig(host=broker.host, port=broker.port, **settings)  # type: ignore[arg-type]
        outbox = Outbox(1000)
        connection = Transport(
            config,
            client_id=f"t-{uuid.uuid4().hex[:8]}",
            outbox=outbox,
            on_message=on_message,
            subscriptions=subscriptions,
            will=lambda epoch: OutMessage("t/will", b"offline", 1, retain=False),
            on_connected=lambda epoch: None,
            epoch=EpochStore(tmp_path / f"epoch-{len(made)}"),
        )
        made.append(connection)
        connection.start()
        assert connection.connected.wait(10), connection.last_error
        assert connection.subscribed.wait(10)  # a message published now finds them
        assert connection.fast_path is (paho_kind == "fast")
        return connection, outbox

    yield make
    for connection in made:
        connection.close(timeout=5)


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_publishes_at_every_qos_arrive_in_order_and_are_acknowledged(
    broker: EmbeddedBroker, transport: Callable[..., tuple[Transport, Outbox]], protocol: str
):
    """What the outbox holds goes out in order at its QoS; every QoS 1/2 publish is settled
    by the broker's PUBACK or PUBCOMP, within a window smaller than the burst."""
    topic = f"t/{uuid.uuid4().hex[:8]}"
    peer = Peer(broker, topic)
    try:
        connection, outbox = transport(protocol=protocol, max_inflight=8)
        latencies: list[float] = []
        connection.add_ack_listener(latencies.append)
        sent = [(f"{topic}/{n % 3}", str(n).encode(), n % 3) for n in range(60)]
        for name, payload, qos in sent:
            outbox.put(OutMessage(name, payload, qos))
        assert connection.flush(10)
        got = peer.wait_for(len(sent))
        assert sorted(got, key=lambda m: int(m[1])) == sent
        assert [m for m in got if m[0].endswith("/1")] == [m for m in sent if m[2] == 1]
        assert connection.acked == 40 and len(latencies) == 40 and connection.inflight == 0
        assert connection.publish_failures == 0
    finally:
        peer.close()


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_requests_at_every_qos_are_delivered_and_acknowledged(
    broker: EmbeddedBroker, transport: Callable[..., tuple[Transport, Outbox]], defer: bool
):
    """More QoS 1/2 messages than the broker lets a client hold unacknowledged all arrive
    only if each is acknowledged: at once, or once the handler's deferred
    acknowledgement is sent (from another thread, as the spool writer sends them)."""
    topic = f"t/{uuid.uuid4().hex[:8]}"
    got: list[Incoming] = []
    acks: list[Callable[[], None]] = []
    holder: list[Transport] = []

    def on_message(incoming: Incoming) -> None:
        got.append(incoming)
        if defer and incoming.qos:
            acks.append(holder[0].defer(incoming))

    connection, outbox = transport(on_message, [(f"{topic}/#", 2)])
    holder.append(connection)
    sender = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"s-{topic[-8:]}")
    sender.max_inflight_messages_set(BROKER_INFLIGHT // 2)  # the broker's own limit in, too
    sender.connect(broker.host, broker.port)
    sender.loop_start()
    stop = threading.Event()

    def acknowledge() -> None:
        while not stop.is_set():
            while acks:
                acks.pop(0)()
            outbox.kick()
            time.sleep(0.005)

    acker = threading.Thread(target=acknowledge)
    acker.start()
    try:
        for n in range(90):
            sender.publish(f"{topic}/{n % 3}", str(n).encode(), qos=n % 3)
        deadline = time.monotonic() + 15
        while len(got) < 90 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(int(m.payload) for m in got) == list(range(90))
        assert all(m.qos == int(m.payload) % 3 for m in got)
        assert all(m.deferred == (defer and m.qos > 0) for m in got)
    finally:
        stop.set()
        acker.join(5)
        sender.disconnect()
        sender.loop_stop()


class _Acks:
    """Stands in for the client: records the acknowledgements it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, int]] = []

    def puback_fast(self, mid: int) -> None:
        self.sent.append(("puback", mid, 1))

    def ack(self, mid: int, qos: int) -> None:
        self.sent.append(("ack", mid, qos))


def test_acknowledgements_go_at_once_or_when_deferred_on_their_connection_only():
    """Not deferred: acknowledged as the handler returns (QoS 1/2; QoS 0 has none). Deferred:
    sent by the next pump once queued, QoS 1 the fast way; one queued for an older
    connection is dropped (the broker delivers the message again)."""
    deferring: set[int] = {3, 4, 5}
    acks: dict[int, Callable[[], None]] = {}
    inbound: Inbound

    def on_message(incoming: Incoming) -> None:
        if incoming.mid in deferring:
            acks[incoming.mid] = inbound.defer(incoming)

    inbound = Inbound(on_message, mqtt5=True)
    client = _Acks()
    inbound.client = client  # type: ignore[assignment]
    inbound.connection = 1
    for mid, qos in ((1, 1), (2, 2), (3, 1), (4, 2), (5, 1), (6, 0)):
        inbound.deliver("t", b"", qos, mid, False, None, False)
    assert client.sent == [("ack", 1, 1), ("ack", 2, 2)]
    acks[4]()
    acks[3]()
    inbound.send_deferred(client)  # type: ignore[arg-type]
    assert client.sent[2:] == [("ack", 4, 2), ("puback", 3, 1)]
    inbound.connection = 2  # reconnected: the broker sends message 5 again
    acks[5]()
    inbound.send_deferred(client)  # type: ignore[arg-type]
    assert len(client.sent) == 4 and not inbound.deferred


BATCH = 4  # messages a kick: under the window the broker allows (BROKER_INFLIGHT, MQTT 5)


def _stream(outbox: Outbox, topic: str, qos: int, batches: int, stop: threading.Event) -> None:
    """A streaming worker's publishing: a few messages a step-batch, each batch followed by
    the send hold's kick (`kick(read=True)`), about a millisecond apart."""
    for batch in range(batches):
        outbox.put_many([OutMessage(topic, f"{batch}/{n}".encode(), qos) for n in range(BATCH)])
        outbox.kick(read=True)
        if stop.wait(0.001):
            return


@pytest.mark.parametrize("qos", [1, 0])
def test_a_streaming_workers_kicks_read_the_socket_while_messages_are_in_flight(
    broker: EmbeddedBroker, transport: Callable[..., tuple[Transport, Outbox]], qos: int
):
    """While a worker's stream has QoS 1 messages in flight, its kicks read what the broker
    sent: acknowledgements are settled on the worker's thread (the window never fills: then
    the io thread reads too), and requests arriving meanwhile are all delivered, on whichever
    thread read them; every message still arrives, in order, acknowledged. At QoS 0 (nothing
    in flight) the kicks do not read. Once the worker stops, the io thread reads again."""
    topic = f"t/{uuid.uuid4().hex[:8]}"
    peer = Peer(broker, f"{topic}/out")
    readers: list[tuple[str, str]] = []  # (request payload, thread that handled it)

    def on_message(incoming: Incoming) -> None:
        readers.append((incoming.payload.decode(), threading.current_thread().name))

    connection, outbox = transport(on_message, [(f"{topic}/in", 1)], max_inflight=64)
    settled_on: set[str] = set()  # the threads that read acknowledgements
    connection.add_ack_listener(lambda latency: settled_on.add(threading.current_thread().name))
    sender = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"s-{topic[-8:]}")
    sender.connect(broker.host, broker.port)
    sender.loop_start()
    stop = threading.Event()
    worker = threading.Thread(
        target=_stream, args=(outbox, f"{topic}/out", qos, 600, stop), name="test-worker"
    )
    try:
        worker.start()
        for n in range(20):  # requests arriving while the stream runs
            sender.publish(f"{topic}/in", f"during-{n}".encode(), qos=1).wait_for_publish(5)
            time.sleep(0.01)
        worker.join(30)
        assert not worker.is_alive()
        sender.publish(f"{topic}/in", b"after", qos=1).wait_for_publish(5)
        assert connection.flush(10)
        got = peer.wait_for(600 * BATCH)
        sent = [f"{b}/{n}".encode() for b in range(600) for n in range(BATCH)]
        assert [m[1] for m in got] == sent
        assert connection.acked == (len(sent) if qos else 0)
        deadline = time.monotonic() + 5
        while len(readers) < 21 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(p for p, _ in readers) == sorted(
            ["after", *(f"during-{n}" for n in range(20))]
        )
        assert ("test-worker" in settled_on) is (qos == 1)
        if not qos:
            assert {thread for _, thread in readers} == {"mqtt-io"}
        assert dict(readers)["after"] == "mqtt-io"
    finally:
        stop.set()
        worker.join(5)
        sender.disconnect()
        sender.loop_stop()
        peer.close()
