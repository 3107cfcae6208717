"""The fast client of `agent.mqtt.paho_fast`, against paho's own: the same packets written,
the same messages and errors read, on every paho version it was written for; the version
check and the plain client it falls back to. The one test module that reaches into paho's
private state (as the module under test does)."""

from __future__ import annotations

import logging
import struct
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt import paho_fast
from agent.mqtt.messages import RequestProperties, parse_publish
from agent.mqtt.paho_fast import FastClient, fast_path_problem, new_client
from agent.mqtt.paho_plain import Client


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
    its socket (on_message, or the agent's `deliver`) and acknowledges, the retain flag
    included (the agent ignores a retained request)."""
    client = kind(
        CallbackAPIVersion.VERSION2, client_id="t", protocol=protocol, manual_ack=manual_ack
    )
    seen: list[tuple[object, ...]] = []
    acks: list[int] = []
    client.on_message = lambda c, u, m: seen.append(
        (m.topic, bytes(m.payload), m.qos, m.dup, m.retain, m.mid,
         getattr(getattr(m, "properties", None), "ResponseTopic", None),
         getattr(getattr(m, "properties", None), "CorrelationData", None))
    )  # fmt: skip
    if isinstance(client, FastClient):
        client.deliver = lambda topic, payload, qos, mid, dup, props, retain: seen.append(
            (topic, payload, qos, dup, retain, mid,
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


def _queued_client(protocol: MQTTProtocolVersion, kind: type[mqtt.Client] = FastClient) -> Any:
    """A client that believes it is connected: packets stay in paho's write queue."""
    client = kind(CallbackAPIVersion.VERSION2, client_id="t", protocol=protocol)
    client._sock = _Unsent()  # type: ignore[assignment]
    client.on_socket_register_write = lambda c, u, s: None
    return client


def _last_written(client: FastClient) -> bytes:
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
    client.deliver = lambda topic, payload, qos, mid, dup, props, retain: got.append(topic)
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
    client.deliver = lambda topic, payload, qos, mid, dup, props, retain: got.append(
        (topic, len(payload))
    )
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
    client.deliver = lambda topic, payload, qos, mid, dup, props, retain: got.append(payload)
    small = _packet(0x30, _publish_body(b"a", 0, b"s", None))
    big_payload = bytes(range(256)) * (3 * 4096)
    stream = small + _packet(0x30, _publish_body(b"a", 0, big_payload, None)) + small
    step = FastClient.READ_SIZE
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
        (0x30, _publish_body(b"", 0, b"no topic", None)),  # a topic alias would name it
    ]
    for header, body in cases:
        for manual_ack in (False, True):  # the agent acknowledges a request once it is stored
            ours = _received(FastClient, header, body, manual_ack)
            theirs = _received(mqtt.Client, header, body, manual_ack)
            assert ours == theirs, (header, body, manual_ack)
    mqtt3 = [
        (0x32, struct.pack("!H", 3) + b"a/b" + struct.pack("!H", 9) + b"\xa1\x62id\x61x"),
        (0x30, struct.pack("!H", 3) + b"a/b" + b"qos 0"),
        (0x3A, struct.pack("!H", 1) + b"t" + struct.pack("!H", 2)),  # dup, empty payload
        (0x32, struct.pack("!H", 2) + b"\xff\xfe" + struct.pack("!H", 1) + b"p"),  # not UTF-8
        (0x32, b"\x00\x01t\x00"),  # half a packet id
        (0x34, struct.pack("!H", 1) + b"t" + struct.pack("!H", 4) + b"qos 2"),
        (0x32, struct.pack("!H", 0) + struct.pack("!H", 5) + b"p"),  # no topic: an error
    ]
    for header, body in mqtt3:
        for manual_ack in (False, True):
            v311 = MQTTProtocolVersion.MQTTv311
            ours = _received(FastClient, header, body, manual_ack, v311)
            theirs = _received(mqtt.Client, header, body, manual_ack, v311)
            assert ours == theirs, (header, body, manual_ack)
    fast = parse_publish(_publish_body(b"t", 1, b"p", both)[:], 1)
    assert fast is not None and fast[2] == RequestProperties("edge/reply/é", b"\x00\x01corr")


def test_inbound_traffic_counts_for_keepalive(monkeypatch: pytest.MonkeyPatch):
    """paho pings when nothing came in for a keepalive period; what the fast reader reads
    counts as coming in. paho 2.1 keeps that time as `_last_msg_in`, 2.2 as
    `_last_bytes_received`: a reader that writes the other name leaves keepalive blind to
    inbound traffic (paho's `loop_misc` is what decides here, on a clock of the test's)."""
    now = [1000.0]
    monkeypatch.setattr(mqtt, "time_func", lambda: now[0])
    publish = _packet(0x30, _publish_body(b"a/b", 0, b"x", None))
    for traffic in (True, False):
        now[0] = 1000.0
        client = _queued_client(MQTTProtocolVersion.MQTTv5)
        assert client.keepalive == 60
        client._sock = _Feed(_packet(0x20, b"\x00\x00\x00"))  # type: ignore[assignment]
        assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS  # CONNACK: connected
        now[0] = 1030.0
        if traffic:
            client._sock = _Feed(publish)  # type: ignore[assignment]
            assert client.loop_read() == MQTTErrorCode.MQTT_ERR_SUCCESS
        now[0] = 1070.0
        client._last_msg_out = now[0]  # something went out just now: only inbound decides
        assert client.loop_misc() == MQTTErrorCode.MQTT_ERR_SUCCESS
        pinged = client.want_write() and _last_written(client) == b"\xc0\x00"
        assert pinged is not traffic, f"traffic={traffic}, paho {mqtt_version()}"


def mqtt_version() -> str:
    return paho_fast.PAHO_VERSION


def test_the_fast_client_is_used_only_on_the_paho_versions_it_was_written_for():
    """On this paho (one of those `.ci/run` tests) it is; on any other minor version, or
    on one that lacks a private name it uses, paho's own client is, and the reason says why."""
    assert paho_fast.FAST_PATH_PROBLEM is None, paho_fast.FAST_PATH_PROBLEM
    assert mqtt_version()[:3] in paho_fast.TESTED_VERSIONS
    this = mqtt_version()[:3]
    for version in (f"{this}.0", f"{this}.9"):
        assert fast_path_problem(version, mqtt.Client) is None, version
    for other, stamp in paho_fast.TESTED_VERSIONS.items():  # a version its client belies
        if other != this:
            assert stamp in (fast_path_problem(f"{other}.0", mqtt.Client) or "")
    for version in ("2.3.0", "3.0.0", "2.0.0", "1.6.1", "unknown"):
        problem = fast_path_problem(version, mqtt.Client)
        assert problem is not None and version in problem and "2.1.x, 2.2.x" in problem

    class Renamed(mqtt.Client):  # a paho that renamed a method the fast client overrides
        _sock_recv = None  # type: ignore[assignment]

    class Restamped(mqtt.Client):  # one whose keepalive reads neither name
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            for name in ("_last_msg_in", "_last_bytes_received", "_out_packet"):
                self.__dict__.pop(name, None)

    assert "_sock_recv" in (fast_path_problem(mqtt_version(), Renamed) or "")
    problem = fast_path_problem(mqtt_version(), Restamped) or ""
    assert "_out_packet" in problem and paho_fast.TESTED_VERSIONS[mqtt_version()[:3]] in problem


def test_an_unknown_paho_gets_the_plain_client_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.delenv(paho_fast.PLAIN_ENV, raising=False)
    monkeypatch.setattr(paho_fast, "_announced", set())
    v5 = MQTTProtocolVersion.MQTTv5
    assert type(new_client("t", v5)) is FastClient
    monkeypatch.setattr(paho_fast, "FAST_PATH_PROBLEM", "paho-mqtt 2.3.0 is not one ...")
    with caplog.at_level(logging.INFO, logger=paho_fast.__name__):
        clients = [new_client("t", v5, manual_ack=True) for _ in range(3)]
    assert all(type(c) is Client for c in clients)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2.3.0" in warnings[0].getMessage()
    assert type(new_client("t", v5, fast=True)) is FastClient  # asked for: a test's choice
    monkeypatch.setattr(paho_fast, "FAST_PATH_PROBLEM", None)
    monkeypatch.setenv(paho_fast.PLAIN_ENV, "plain")
    assert type(new_client("t", v5)) is Client


def test_the_plain_client_writes_what_paho_writes_and_passes_on_only_acknowledgements():
    """paho's own publish and ack behind the fast client's interface. paho calls on_publish
    for a written QoS 0 message too, with an id that may repeat one still awaiting its PUBACK
    (the ids wrap at 65535): that call must not settle the other message."""
    for protocol in (MQTTProtocolVersion.MQTTv5, MQTTProtocolVersion.MQTTv311):
        ours = _queued_client(protocol, Client)
        theirs = _queued_client(protocol, mqtt.Client)
        ours._manual_ack = theirs._manual_ack = True
        for qos in (0, 1, 2):
            rc, mid = ours.publish_fast("edge/é/r", b"p", qos, False, None)
            info = theirs.publish("edge/é/r", b"p", qos, False, None)
            assert (rc, mid) == (info.rc, info.mid if qos else 0)
            assert ours._out_packet[-1]["packet"] == theirs._out_packet[-1]["packet"]
        ours.puback_fast(0x1234)
        theirs.ack(0x1234, 1)
        assert ours._out_packet[-1]["packet"] == theirs._out_packet[-1]["packet"]
        assert ours.unsent() == 0
    client = _queued_client(MQTTProtocolVersion.MQTTv5, Client)
    acked: list[tuple[int, int]] = []
    client.acknowledged = lambda mid, reason: acked.append((mid, reason.value))
    first = client.publish_fast("t", b"1", 1, False, None)[1]
    client._last_mid = first - 1  # the ids came round: the next QoS 0 message reuses it
    assert client.publish_fast("t", b"0", 0, False, None) == (MQTTErrorCode.MQTT_ERR_SUCCESS, 0)
    client._last_mid = first - 1
    again = client.publish_fast("t", b"2", 1, False, None)[1]  # paho refuses the id in use
    assert again == first + 1
    assert client.loop_write() == MQTTErrorCode.MQTT_ERR_SUCCESS and not client.want_write()
    assert acked == []  # the QoS 0 write is not the PUBACK of `first`
    pubacks = _packet(0x40, struct.pack("!H", first)) + _packet(0x40, struct.pack("!H", again))
    client._sock = _Feed(pubacks)  # type: ignore[assignment]
    assert client.loop_read(2) == MQTTErrorCode.MQTT_ERR_SUCCESS
    assert acked == [(first, 0), (again, 0)]
    client._sock = None
    assert client.publish_fast("t", b"", 0, False, None)[0] == MQTTErrorCode.MQTT_ERR_NO_CONN


def test_parse_publish_reads_a_request_with_its_properties():
    both = Properties(PacketTypes.PUBLISH)
    both.ResponseTopic = "edge/reply/é"
    both.CorrelationData = b"\x00\x01corr"
    fast = parse_publish(_publish_body(b"t", 1, b"p", both), 1)
    assert fast == (b"t", 7, RequestProperties("edge/reply/é", b"\x00\x01corr"), b"p")
    assert parse_publish(_publish_body(b"", 1, b"p", both), 1) is None  # paho's to read
