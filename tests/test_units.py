"""Unit tests of the pieces with no broker: scheduler, outbox, config, backoff, epoch, and
the MQTT 5 PUBLISH reader."""

from __future__ import annotations

import random
import struct
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.config import ConfigError, load_config, masked_dict, to_toml
from agent.delivery.outbox import Outbox, OutboxClosed, OutMessage
from agent.inference.scheduler import Scheduler
from agent.mqtt.transport import (
    EpochStore,
    RequestProperties,
    _Client,
    backoff_delays,
    parse_publish,
)


def test_scheduler_priority_then_fifo_and_deadlines():
    gate = threading.Event()
    order: list[str] = []
    expired: list[str] = []
    done = threading.Event()

    def execute(job: str, queued: float) -> None:
        if job == "block":
            gate.wait(5)
            return
        order.append(job)
        if len(order) == 5:
            done.set()

    scheduler: Scheduler[str] = Scheduler(
        workers=1, queue_size=10, execute=execute, expire=expired.append, cancel=lambda j: None
    )
    scheduler.start()
    assert scheduler.submit("block", 9)
    time.sleep(0.05)
    for job, priority in [("low-a", 1), ("high-a", 8), ("low-b", 1), ("high-b", 8), ("mid", 4)]:
        assert scheduler.submit(job, priority)
    assert scheduler.submit("late", 9, deadline_s=0.0)
    gate.set()
    assert done.wait(5)
    assert order == ["high-a", "high-b", "mid", "low-a", "low-b"]
    assert expired == ["late"]
    scheduler.stop(1)


def test_scheduler_refuses_when_full_and_cancels_on_stop():
    gate = threading.Event()
    cancelled: list[str] = []
    scheduler: Scheduler[str] = Scheduler(
        workers=1,
        queue_size=2,
        execute=lambda j, q: gate.wait(5),
        expire=lambda j: None,
        cancel=cancelled.append,
    )
    scheduler.start()
    assert scheduler.submit("running", 4)
    time.sleep(0.05)
    assert scheduler.submit("a", 4) and scheduler.submit("b", 4)
    assert not scheduler.submit("c", 4)  # full: the caller answers `overloaded`
    gate.set()
    scheduler.stop(2)
    assert sorted(cancelled) in (["a", "b"], ["b"], [])
    assert not scheduler.submit("after", 4)


def test_outbox_blocks_when_full_and_keeps_order():
    box = Outbox(max_messages=2, reserve=1)
    box.put(OutMessage("t", b"1", 1))
    box.put(OutMessage("t", b"2", 1))
    with pytest.raises(TimeoutError):
        box.put(OutMessage("t", b"3", 1), timeout=0.05)
    assert box.put_nowait_reserved(OutMessage("t", b"err", 1))
    assert not box.put_nowait_reserved(OutMessage("t", b"err2", 1))
    assert box.rejected == 1
    first = box.get(0.1)
    assert first is not None and first.payload == b"1"
    box.unget(first)
    assert [box.get(0.1).payload for _ in range(3)] == [b"1", b"2", b"err"]  # type: ignore[union-attr]
    box.close()
    with pytest.raises(OutboxClosed):
        box.put(OutMessage("t", b"x", 1))
    assert box.get(0.1) is None


def test_outbox_put_many_keeps_order_and_waits_for_room():
    box = Outbox(max_messages=2)
    kicked: list[int] = []
    box.set_on_queued(lambda: kicked.append(1))
    messages = [OutMessage("t", str(n).encode(), 1) for n in range(5)]
    putter = threading.Thread(target=box.put_many, args=(messages,))
    putter.start()
    got = [box.get(2.0) for _ in range(5)]  # room for two at a time: it waits, in order
    putter.join(2.0)
    assert not putter.is_alive()
    assert [m.payload for m in got if m is not None] == [b"0", b"1", b"2", b"3", b"4"]
    assert not kicked  # the caller kicks once, after its last message
    box.close()
    with pytest.raises(OutboxClosed):
        box.put_many([OutMessage("t", b"x", 1)])


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


def test_config_errors_name_key_and_file(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text('[mqtt]\nport = "x"\nhostt = "a"\n[models]\nrepository = "m"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    problems = info.value.problems
    assert f"{path}: unknown key 'mqtt.hostt'" in problems
    assert any(p.startswith(f"{path}: mqtt.port:") for p in problems)


def test_config_environment_overrides_and_masking(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text(
        'device_id = "box"\n[mqtt]\nport = 1883\nusername = "u"\npassword_file = "pw"\n'
    )
    config = load_config(
        path, {"EDGE_AGENT__MQTT__PORT": "1884", "EDGE_AGENT__MQTT__PROTOCOL": "3.1.1"}
    )
    assert config.mqtt.port == 1884 and config.mqtt.protocol == "3.1.1"
    assert config.mqtt.password_file == tmp_path / "pw"
    text = to_toml(masked_dict(config))
    assert 'password_file = "***"' in text and "pw" not in text.replace("password_file", "")
    with pytest.raises(ConfigError) as info:
        load_config(path, {"EDGE_AGENT__MQTT__NOPE": "1"})
    assert info.value.problems == ["environment EDGE_AGENT__MQTT__NOPE: unknown key 'mqtt.nope'"]


def test_config_rejects_bad_toml_and_missing_file(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text("device_id = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, {})
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.toml", {})


def _publish_body(
    topic: bytes, qos: int, payload: bytes, props: Properties | None, raw_props: bytes | None = None
) -> bytes:
    body = struct.pack("!H", len(topic)) + topic + (struct.pack("!H", 7) if qos else b"")
    if raw_props is not None:
        body += raw_props
    else:
        body += props.pack() if props is not None else b"\x00"
    return body + payload


def _packet(header: int, body: bytes) -> bytes:
    """A whole MQTT packet: the type byte, the remaining length (1-4 bytes), the body."""
    length, n = bytearray(), len(body)
    while True:
        n, digit = n >> 7, n & 0x7F
        length.append(digit | (0x80 if n else 0))
        if not n:
            return bytes([header]) + bytes(length) + body


def _received(
    kind: type[mqtt.Client],
    header: int,
    body: bytes,
    manual_ack: bool,
    protocol: MQTTProtocolVersion = MQTTProtocolVersion.MQTTv5,
) -> object:
    """What a client of `kind` (paho's, or the agent's) hands on after reading the packet from
    its socket (on_message, or the agent's `deliver`) and acknowledges. The retain flag is
    not compared: requests ignore it."""
    client = kind(
        CallbackAPIVersion.VERSION2, client_id="t", protocol=protocol, manual_ack=manual_ack
    )
    seen: list[tuple[object, ...]] = []
    acks: list[int] = []
    client.on_message = lambda c, u, m: seen.append(
        (m.topic, bytes(m.payload), m.qos, m.dup, m.mid,
         getattr(getattr(m, "properties", None), "ResponseTopic", None),
         getattr(getattr(m, "properties", None), "CorrelationData", None))
    )  # fmt: skip
    if isinstance(client, _Client):
        client.deliver = lambda topic, payload, qos, mid, dup, props: seen.append(
            (topic, payload, qos, dup, mid,
             getattr(props, "ResponseTopic", None), getattr(props, "CorrelationData", None))
        )  # fmt: skip
    client._send_puback = lambda mid: acks.append(mid) or MQTTErrorCode.MQTT_ERR_SUCCESS  # type: ignore[method-assign]
    client._sock = _Feed(_packet(header, body))  # type: ignore[assignment]
    try:
        rc = client.loop_read()
    except Exception as e:  # paho's own reports of a malformed packet
        return type(e).__name__
    return rc, seen, acks


class _Unsent:
    """Takes what is sent (a client closing with bytes still buffered sends them first)."""

    def send(self, data: bytes) -> int:
        return len(data)

    def close(self) -> None:
        pass


def _queued_client(protocol: MQTTProtocolVersion) -> _Client:
    """A client that believes it is connected: packets stay in paho's write queue."""
    client = _Client(CallbackAPIVersion.VERSION2, client_id="t", protocol=protocol)
    client._sock = _Unsent()  # type: ignore[assignment]
    client.on_socket_register_write = lambda c, u, s: None
    return client


def _last_written(client: _Client) -> bytes:
    """The last packet queued or buffered for the socket."""
    if client._out_packet:
        return bytes(client._out_packet[-1]["packet"])
    return bytes(client._wbuf[-1])


class _Recorder(_Unsent):
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:  # type: ignore[override]
        self.sent.append(bytes(data))
        return len(data)


def test_publish_fast_keeps_call_order_with_paho_packets():
    client = _queued_client(MQTTProtocolVersion.MQTTv311)
    sock = client._sock = _Recorder()  # type: ignore[assignment]
    client.publish_fast("t/1", b"a", 1, False, None)  # straight into the write buffer
    client._send_puback(7)  # paho's own packet, queued after it
    client.publish_fast("t/2", b"b", 0, False, None)  # behind the PUBACK, not before it
    client.publish_fast("t/3", b"c", 1, False, None)
    assert client.loop_write() == MQTTErrorCode.MQTT_ERR_SUCCESS
    written = b"".join(sock.sent)
    marks = [written.index(m) for m in (b"t/1", b"\x40\x02\x00\x07", b"t/2", b"t/3")]
    assert marks == sorted(marks)
    assert not client.want_write()


def test_publish_fast_packs_a_topic_it_has_seen_as_paho_does():
    """Topics are packed once and kept (bounded): a topic seen before, or dropped from the
    cache when it filled, still gives paho's packet; an invalid one is refused every time."""
    ours = _queued_client(MQTTProtocolVersion.MQTTv5)
    theirs = _queued_client(MQTTProtocolVersion.MQTTv5)
    topics = ["edge/d/result/m/first", *(f"edge/d/result/m/{n}" for n in range(1100))]
    for topic in [*topics, topics[0], topics[0]]:
        ours.publish_fast(topic, b"p", 0, False, None)
        theirs.publish(topic, b"p", 0, False, None)
        assert _last_written(ours) == theirs._out_packet[-1]["packet"]
    assert len(ours._topics) <= ours._topics.LIMIT
    for _ in range(2):
        with pytest.raises(ValueError):
            ours.publish_fast("edge/+/x", b"", 0, False, None)


def test_puback_fast_writes_what_paho_writes_in_call_order():
    for protocol in (MQTTProtocolVersion.MQTTv5, MQTTProtocolVersion.MQTTv311):
        ours, theirs = _queued_client(protocol), _queued_client(protocol)
        theirs._manual_ack = True
        ours.puback_fast(0x1234)
        theirs.ack(0x1234, 1)
        assert _last_written(ours) == theirs._out_packet[-1]["packet"] == b"\x40\x02\x12\x34"
    client = _queued_client(MQTTProtocolVersion.MQTTv5)
    sock = client._sock = _Recorder()  # type: ignore[assignment]
    client.puback_fast(1)  # straight into the write buffer
    client._send_puback(2)  # paho's own, queued after it
    client.puback_fast(3)  # behind paho's, not before it
    assert client.loop_write() == MQTTErrorCode.MQTT_ERR_SUCCESS
    assert b"".join(sock.sent) == b"".join(struct.pack("!BBH", 0x40, 2, m) for m in (1, 2, 3))


def test_publish_fast_writes_the_packet_paho_writes_and_takes_its_puback():
    corr = Properties(PacketTypes.PUBLISH)
    corr.CorrelationData = b"\x00c"
    big = b"x" * 20000  # a remaining length of three bytes
    for protocol in (MQTTProtocolVersion.MQTTv5, MQTTProtocolVersion.MQTTv311):
        for qos in (0, 1):
            for retain in (False, True):
                for props in (None, corr) if protocol == MQTTProtocolVersion.MQTTv5 else (None,):
                    for payload in (b"", b"\xa1ax\x01", big):
                        ours, theirs = _queued_client(protocol), _queued_client(protocol)
                        rc, mid = ours.publish_fast("edge/é/result", payload, qos, retain, props)
                        info = theirs.publish("edge/é/result", payload, qos, retain, props)
                        assert (rc, mid if qos else 0) == (info.rc, info.mid if qos else 0)
                        assert _last_written(ours) == theirs._out_packet[-1]["packet"]
    client = _queued_client(MQTTProtocolVersion.MQTTv5)
    acked: list[tuple[int, int]] = []
    client.acknowledged = lambda mid, reason: acked.append((mid, reason.value))
    first = client.publish_fast("t", b"a", 1, False, None)[1]
    second = client.publish_fast("t", b"b", 1, False, None)[1]
    for body in (struct.pack("!H", first), struct.pack("!HB", second, 0x87) + b"\x00"):
        client._sock = _Feed(_packet(0x40, body))  # type: ignore[assignment]
        assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS
    client._sock = _Feed(_packet(0x40, struct.pack("!H", first)))  # type: ignore[assignment]
    assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS  # a duplicate: ignored
    assert acked == [(first, 0), (second, 0x87)]  # success, then "not authorized"
    for topic in ("", "a/+/b", "a/#"):
        with pytest.raises(ValueError):
            client.publish_fast(topic, b"", 1, False, None)
    client._sock = None
    assert client.publish_fast("t", b"", 1, False, None)[0] == MQTTErrorCode.MQTT_ERR_NO_CONN


class _Feed(_Unsent):
    """A socket whose reads return `data` once, then nothing yet."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def recv(self, size: int) -> bytes:
        if not self.data:
            raise BlockingIOError
        out, self.data = self.data[:size], self.data[size:]
        return out


def test_one_loop_read_handles_every_packet_the_socket_held():
    """paho reads one packet per call when its own books hold no message: the agent's
    publishes are not in them, so its client reads on while the buffer holds packets."""
    client = _queued_client(MQTTProtocolVersion.MQTTv5)
    acked: list[int] = []
    got: list[str] = []
    client.acknowledged = lambda mid, reason: acked.append(mid)
    client.deliver = lambda topic, payload, qos, mid, dup, props: got.append(topic)
    mids = [client.publish_fast("t", b"x", 1, False, None)[1] for _ in range(3)]
    body = _publish_body(b"a/b", 0, b"", None)
    publish = bytes([0x30, len(body)]) + body
    pubacks = b"".join(bytes([0x40, 2]) + struct.pack("!H", mid) for mid in mids)
    half = publish[:4]
    client._sock = _Feed(pubacks + publish + publish + half)  # type: ignore[assignment]
    assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS
    assert acked == mids and got == ["a/b", "a/b"]  # the half packet waits for its rest
    client._sock = _Feed(publish[4:])  # type: ignore[assignment]
    assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS
    assert got == ["a/b"] * 3


class _Trickle(_Unsent):
    """A socket whose reads return the next of `pieces`, then nothing yet; b"": closed."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def recv(self, size: int) -> bytes:
        if not self.pieces:
            raise BlockingIOError
        piece = self.pieces.pop(0)
        if len(piece) > size:
            self.pieces.insert(0, piece[size:])
        return piece[:size]


def test_packets_are_framed_across_reads_split_anywhere():
    """Every packet is read whole however the stream is cut: lengths of one to three bytes,
    a cut in the type byte, in the length and in the body. Packets without a fast path
    (a SUBACK, a PINGRESP) reach paho's handlers as paho's reader would pass them."""
    client = _queued_client(MQTTProtocolVersion.MQTTv5)
    got: list[tuple[str, int]] = []
    acked: list[int] = []
    subacked: list[int] = []
    client.deliver = lambda topic, payload, qos, mid, dup, props: got.append((topic, len(payload)))
    client.acknowledged = lambda mid, reason: acked.append(mid)
    client.on_subscribe = lambda c, u, mid, codes, props: subacked.append(mid)
    client._send_puback = lambda mid: MQTTErrorCode.MQTT_ERR_SUCCESS  # type: ignore[method-assign]
    mid = client.publish_fast("t", b"x", 1, False, None)[1]
    sizes = (0, 100, 200, 20000)  # remaining lengths of one, two and three bytes
    stream = b"".join(_packet(0x32, _publish_body(b"a/b", 1, b"p" * n, None)) for n in sizes)
    stream += _packet(0x40, struct.pack("!H", mid)) + _packet(0xD0, b"")  # PUBACK, PINGRESP
    stream += _packet(0x90, struct.pack("!H", 7) + b"\x00\x01")  # SUBACK: no properties, QoS 1
    expected = [("a/b", n) for n in sizes]
    for cut in (1, 2, 3, 5, 150, 20010, len(stream) - 1):
        for second in (cut + 1, cut + 7):
            got.clear()
            acked.clear()
            subacked.clear()
            client._fast_inflight.add(mid)
            pieces = [stream[:cut], stream[cut:second], stream[second:]]
            client._sock = _Trickle([p for p in pieces if p])  # type: ignore[assignment]
            for _ in range(3):
                assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS
            assert got == expected and acked == [mid] and subacked == [7], cut
            assert client._rbuf == b"" and client._in_packet["command"] == 0


def test_a_packet_larger_than_a_read_arrives_whole():
    """A 3 MB request behind a small one, read 64 KiB at a time as the socket gives it."""
    client = _queued_client(MQTTProtocolVersion.MQTTv5)
    got: list[bytes] = []
    client.deliver = lambda topic, payload, qos, mid, dup, props: got.append(payload)
    small = _packet(0x30, _publish_body(b"a", 0, b"s", None))
    big_payload = bytes(range(256)) * (3 * 4096)
    stream = small + _packet(0x30, _publish_body(b"a", 0, big_payload, None)) + small
    step = _Client.READ_SIZE
    client._sock = _Trickle([stream[i : i + step] for i in range(0, len(stream), step)])  # type: ignore[assignment]
    while client._sock.pieces:  # type: ignore[union-attr]
        assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS
    assert got == [b"s", big_payload, b"s"]
    assert not client._rbuf


def test_reading_ends_the_connection_on_a_bad_length_or_a_close():
    """A fifth length byte is a protocol error (as paho reads it); a closed socket is a lost
    connection. Either way what was left of a packet is dropped with the socket."""
    for data, rc in (
        ([b"\x30\x80\x80\x80\x80\x01"], MQTTErrorCode.MQTT_ERR_PROTOCOL),
        ([b"\x30\x05ab", b""], MQTTErrorCode.MQTT_ERR_CONN_LOST),
    ):
        ours = _queued_client(MQTTProtocolVersion.MQTTv5)
        theirs = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="t")
        theirs.on_socket_register_write = lambda c, u, s: None
        lost: list[int] = []
        for client in (ours, theirs):
            client.on_disconnect = lambda c, u, flags, reason, props, lost=lost: lost.append(1)
            client._sock = _Trickle(list(data))  # type: ignore[assignment]
            results = [client.loop_read() for _ in range(8)]
            assert rc in results
            assert client._sock is None
        assert lost == [1, 1]
        assert ours._rbuf == b""


def test_publish_fast_path_reads_what_paho_reads():
    """The agent reads request PUBLISH packets without paho's Properties object; for every
    packet the result (or the error) is paho's own."""
    both = Properties(PacketTypes.PUBLISH)
    both.ResponseTopic = "edge/reply/é"
    both.CorrelationData = b"\x00\x01corr"
    only_topic = Properties(PacketTypes.PUBLISH)
    only_topic.ResponseTopic = "r/1"
    user = Properties(PacketTypes.PUBLISH)
    user.UserProperty = ("k", "v")
    alias = Properties(PacketTypes.PUBLISH)
    alias.TopicAlias = 3
    cases = [
        (0x32, _publish_body(b"edge/d/infer/m", 1, b"\xa1\x62id\x61x", None)),
        (0x30, _publish_body(b"edge/d/infer/m", 0, b"payload", None)),
        (0x3A, _publish_body(b"t", 1, b"dup", None)),
        (0x31, _publish_body(b"t", 0, b"retain", None)),
        (0x32, _publish_body(b"t", 1, b"p", both)),
        (0x32, _publish_body(b"t", 1, b"", only_topic)),
        (0x32, _publish_body(b"t", 1, b"p", user)),  # other properties: paho's way
        (0x32, _publish_body(b"t", 1, b"p", alias)),
        (0x34, _publish_body(b"t", 1, b"qos 2", both)),
        (0x32, _publish_body(b"t", 1, b"p", None, raw_props=b"\x80\x80\x80\x80\x01")),
        (0x32, _publish_body(b"t", 1, b"", None, raw_props=b"\x05\x08\x00\x09ab")),  # short
        (0x32, _publish_body(b"t", 1, b"", None, raw_props=b"\x04\x08\x00\x02\xff\xfe")),
        (0x32, _publish_body(b"t", 1, b"", None, raw_props=b"\x06\x09\x00\x01a\x09\x00")),
        (0x32, b"\x00\x09short"),  # the topic runs past the packet
        (0x32, b"\x00\x01t"),  # no packet id
    ]
    for header, body in cases:
        for manual_ack in (False, True):  # the agent acknowledges a request once it is stored
            ours = _received(_Client, header, body, manual_ack)
            theirs = _received(mqtt.Client, header, body, manual_ack)
            assert ours == theirs, (header, body, manual_ack)
    mqtt3 = [
        (0x32, struct.pack("!H", 3) + b"a/b" + struct.pack("!H", 9) + b"\xa1\x62id\x61x"),
        (0x30, struct.pack("!H", 3) + b"a/b" + b"qos 0"),
        (0x3A, struct.pack("!H", 1) + b"t" + struct.pack("!H", 2)),  # dup, empty payload
        (0x32, struct.pack("!H", 2) + b"\xff\xfe" + struct.pack("!H", 1) + b"p"),  # not UTF-8
        (0x32, b"\x00\x01t\x00"),  # half a packet id
        (0x34, struct.pack("!H", 1) + b"t" + struct.pack("!H", 4) + b"qos 2"),
    ]
    for header, body in mqtt3:
        for manual_ack in (False, True):
            v311 = MQTTProtocolVersion.MQTTv311
            ours = _received(_Client, header, body, manual_ack, v311)
            theirs = _received(mqtt.Client, header, body, manual_ack, v311)
            assert ours == theirs, (header, body, manual_ack)
    fast = parse_publish(_publish_body(b"t", 1, b"p", both)[:], 1)
    assert fast is not None and fast[2] == RequestProperties("edge/reply/é", b"\x00\x01corr")
