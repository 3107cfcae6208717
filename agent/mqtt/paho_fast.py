"""paho's client behind one wall: the only module of the agent that uses paho's private names.

`new_client` returns one of two clients with the same small interface (`publish_fast`,
`puback_fast`, `unsent`, and the `deliver` and `acknowledged` hooks), so the transport has
one code path:

* `FastClient` reads and writes the socket in bulk and publishes without paho's per-message
  bookkeeping. It overrides private methods of paho and reads its private state, as paho
  2.1.x and 2.2.x have them (read in both versions' source and tested under both: see
  `.ci/run`). One difference between them matters here: the time of the last inbound
  traffic, which keepalive reads, is `_last_msg_in` in 2.1 and `_last_bytes_received` in
  2.2; the fast reader writes the one the running paho reads.
* `agent.mqtt.paho_plain.Client` is paho's own client, none of its methods overridden,
  with the same interface on paho's public API (and the fast client's base). It is used
  where the fast one cannot be trusted: a paho version it was not written for, or one
  lacking a private name it needs (both checked once, at import; logged once at WARNING),
  or when `EDGE_AGENT_PAHO=plain` asks for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import struct
from typing import TYPE_CHECKING, Any

import paho.mqtt
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.mqtt.messages import TopicCache, parse_publish, topic_field
from agent.mqtt.paho_plain import Client

if TYPE_CHECKING:
    from paho.mqtt.client import _InPacket

log = logging.getLogger(__name__)

# paho minor versions the fast client was written and tested for -> the name of the time of
# the last inbound traffic that its keepalive check reads.
TESTED_VERSIONS = {"2.1": "_last_msg_in", "2.2": "_last_bytes_received"}
PLAIN_ENV = "EDGE_AGENT_PAHO"  # "plain": paho's own client whatever the version
# Private methods of paho's Client the fast client calls or overrides, and the private
# attributes of an instance it reads or writes (besides the inbound time above). Each was
# read in 2.1.0's and 2.2.0's client.py: same signature and meaning in both, except that
# 2.2 decodes packets in `paho.mqtt._packet` and raises MalformedPacket (2.1: struct and
# index errors, let through by its own reader as by this one), and 2.2's
# `_pack_remaining_length` refuses lengths over the protocol's limit (checked here first).
PRIVATE_METHODS = (
    "_packet_queue", "_packet_handle", "_easy_log", "_loop_rc_handle", "_mid_generate",
    "_pack_remaining_length", "_sock_send", "_sock_recv", "_sock_close", "_do_on_publish",
    "_send_puback", "_send_pubrel",
)  # fmt: skip
PRIVATE_ATTRIBUTES = (
    "_sock", "_out_packet", "_in_packet", "_out_messages", "_out_message_mutex",
    "_msgtime_mutex", "_manual_ack", "_protocol", "_on_publish",
)  # fmt: skip

_MALFORMED: tuple[type[Exception], ...]
try:  # paho 2.2 reports a malformed packet with this; 2.1 lets the decoding error through
    from paho.mqtt.exception import MalformedPacket

    _MALFORMED = (MalformedPacket,)
except ImportError:
    _MALFORMED = ()


def fast_path_problem(version: str, client_class: type[mqtt.Client]) -> str | None:
    """Why the fast client must not run on paho `version` (None: it may): a version it was
    not written for, or a private name it uses that `client_class` lacks."""
    written_for = ", ".join(f"{v}.x" for v in TESTED_VERSIONS)
    stamp = TESTED_VERSIONS.get(".".join(version.split(".")[:2]))
    if stamp is None:
        return f"paho-mqtt {version} is not one the fast client was written for ({written_for})"
    missing = [n for n in PRIVATE_METHODS if not callable(getattr(client_class, n, None))]
    try:
        probe = client_class(CallbackAPIVersion.VERSION2)
    except Exception as e:  # a changed constructor is as much a reason
        return f"paho-mqtt {version}: cannot make a client to check ({e})"
    missing += [n for n in (*PRIVATE_ATTRIBUTES, stamp) if not hasattr(probe, n)]
    if missing:
        return f"paho-mqtt {version} lacks {', '.join(missing)}, which the fast client uses"
    return None


PAHO_VERSION: str = getattr(paho.mqtt, "__version__", "unknown")
FAST_PATH_PROBLEM = fast_path_problem(PAHO_VERSION, mqtt.Client)
_INBOUND_STAMP = TESTED_VERSIONS.get(".".join(PAHO_VERSION.split(".")[:2]), "_last_bytes_received")
_announced: set[str] = set()


def fast_path_wanted() -> bool:
    """Whether `new_client` gives the fast client: not when this paho is not one it was
    written for (logged once at WARNING), nor when `EDGE_AGENT_PAHO=plain` (logged once)."""
    if os.environ.get(PLAIN_ENV, "").strip().lower() == "plain":
        _announce(logging.INFO, f"{PLAIN_ENV}=plain: paho's own client, no fast path")
        return False
    if FAST_PATH_PROBLEM is not None:
        _announce(logging.WARNING, f"{FAST_PATH_PROBLEM}: paho's own client, no fast path")
        return False
    return True


def _announce(level: int, message: str) -> None:
    if message not in _announced:
        _announced.add(message)
        log.log(level, "mqtt: %s", message)


def new_client(
    client_id: str,
    protocol: MQTTProtocolVersion,
    *,
    clean_session: bool | None = None,
    manual_ack: bool = False,
    fast: bool | None = None,
) -> Client:
    """A client on the callback API 2, reconnects left to the caller; fast unless `fast` is
    False or `fast_path_wanted` says no."""
    kind = FastClient if (fast_path_wanted() if fast is None else fast) else Client
    return kind(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=protocol,
        clean_session=clean_session,
        reconnect_on_failure=False,
        manual_ack=manual_ack,
    )


_PUBACK_SUCCESS = ReasonCode(PacketTypes.PUBACK)  # "Success"; read, never changed
_NO_PROPERTIES = Properties(PacketTypes.PUBACK)  # type: ignore[no-untyped-call]
PUBLISH_COMMAND = 0x30
PUBACK_COMMAND = 0x40
PUBREC_COMMAND = 0x50
# paho marks the info of a written QoS 0 packet as published: one shared info for all of ours.
_WRITTEN = mqtt.MQTTMessageInfo(0)


def _empty_in_packet() -> _InPacket:
    """paho's reading state between packets (as its reader resets it)."""
    return {
        "command": 0,
        "have_remaining": 0,
        "remaining_count": [],
        "remaining_mult": 1,
        "remaining_length": 0,
        "packet": bytearray(b""),
        "to_process": 0,
        "pos": 0,
    }


class FastClient(Client):
    """paho's client, reading and writing the socket in bulk.

    paho reads every packet with at least three `recv` calls (its type byte, its length, its
    body) through a dict of reading state, and writes every packet with its own `send`: on a
    stream of small messages that is four system calls, four releases and retakes of the GIL,
    for each message published. `loop_read` here takes whatever the socket holds with one
    `recv` and frames every complete packet in it (31 µs a request and its reply's PUBACK
    with paho's reader, 5 µs here, in a hot loop); the override of `_sock_send` collects the
    writes of one `loop_write` into one `send` (the rest, if the socket takes only part, goes
    with the next `loop_write`; `want_write` says so).

    paho also builds a ReasonCode and a Properties object (whose constructor rebuilds its
    tables of names every time) for every QoS 0 packet it writes, to call `on_publish`, and
    for every PUBACK it reads. `on_publish` is out of the way while `loop_write` runs; a
    plain success PUBACK (two bytes, or a zero reason code without properties: what
    Mosquitto sends) is answered with one shared success ReasonCode and empty Properties.
    Likewise an MQTT 5 PUBLISH at QoS 0 or 1 whose properties are at most a response topic
    and correlation data (what requests carry) is read without a Properties object (2 µs
    instead of 12 µs per request) and goes to `deliver` directly. Anything else (QoS 2,
    other properties, a malformed packet) takes paho's way, with its errors.

    A QoS 0/1 publish is written by `publish_fast`: paho would build an MQTTMessage for each,
    with an MQTTMessageInfo and its `threading.Condition`, match the topic against its
    callback filters and take two callback locks (a publish: 8.9 µs against 4.9 µs in a hot
    loop). The packet is the same and is written in call order with paho's own packets
    (straight into the write buffer when paho's queue is empty, else through that queue);
    its PUBACK is matched here and reported to `acknowledged`.
    """

    READ_SIZE = 65536

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._released: set[int] = set()  # ids of an earlier connection's QoS 2 flows
        super().__init__(*args, **kwargs)
        self._rbuf = bytearray()  # the start of a packet whose rest has not arrived yet
        self._wbuf: list[bytes | bytearray] = []
        self._fast_inflight: set[int] = set()  # QoS 1 ids from `publish_fast`, unacknowledged
        # Topic -> its checked, length-prefixed bytes: a stream publishes many messages to one.
        self._topics = TopicCache()

    def release(self, mids: set[int]) -> None:
        """PUBREL for each of `mids` (QoS 2 ids of the previous connection, a resumed
        session: the broker answers PUBCOMP, and forwards the message if it held it),
        queued before anything published after; the ids are not reused on this client."""
        self._released |= mids
        for mid in sorted(mids):
            self._send_pubrel(mid)

    def _mid_generate(self) -> int:
        """paho's next message id, past the ids `release` sent PUBREL for."""
        mid: int = super()._mid_generate()
        while mid in self._released:
            mid = super()._mid_generate()
        return mid

    def unsent(self) -> int:
        """Bytes written by paho that the socket has not taken yet."""
        return sum(len(chunk) for chunk in self._wbuf)

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        """One `recv` of whatever the socket holds, and every complete packet in it, framed
        here; the start of a packet whose rest has not arrived waits for the next call.
        paho's reader takes three calls and a dict of state per packet, and handles as many
        packets per call as its books hold messages (those of `publish_fast` are not in
        them). Each packet goes to paho's handler as paho would pass it, except the PUBLISH
        and PUBACK packets of the fast paths."""
        if self._sock is None:
            return MQTTErrorCode.MQTT_ERR_NO_CONN
        try:
            data = self._sock_recv(self.READ_SIZE)
        except BlockingIOError:
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        except OSError as err:  # a timeout and a closed socket included, as paho reads them
            self._easy_log(mqtt.MQTT_LOG_ERR, "failed to receive on socket: %s", err)
            return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_CONN_LOST)
        if not data:
            return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_CONN_LOST)
        with self._msgtime_mutex:  # inbound traffic, for keepalive: the name this paho reads
            setattr(self, _INBOUND_STAMP, mqtt.time_func())
        if self._rbuf:  # the start of a packet: grows in place while a large one arrives
            self._rbuf += data
            buf: bytes | bytearray = self._rbuf
        else:
            buf = data
        pos, size = 0, len(buf)
        while pos < size:
            # The fixed header: the type byte and the remaining length (1-4 bytes, 7 bits each).
            at, length, shift = pos + 1, 0, 0
            while at < size:
                byte = buf[at]
                at += 1
                length |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
                shift += 7
                if shift > 21:  # a fifth length byte: paho's reading too
                    return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_PROTOCOL)
            else:
                break  # the length is not all here yet
            end = at + length
            if end > size:
                break
            rc = self._handle_packet(buf[pos], buf[at:end], buf[pos + 1 : at])
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                return self._loop_rc_handle(rc)
            if self._sock is None:  # a handler ended the connection (a DISCONNECT, say)
                return MQTTErrorCode.MQTT_ERR_NO_CONN
            pos = end
        if pos == size:
            self._rbuf = bytearray()
        elif pos or buf is not self._rbuf:  # kept as is when it only grew: no copy per read
            self._rbuf = bytearray(buf[pos:])
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_packet(
        self, command: int, body: bytes | bytearray, length_bytes: bytes | bytearray
    ) -> MQTTErrorCode:
        """One complete packet: the fast paths, else paho's handler with the packet where
        paho's reader leaves it."""
        kind = command & 0xF0
        rc: MQTTErrorCode | None = None
        if kind == PUBLISH_COMMAND and not command & 0x04:  # QoS 0 or 1
            rc = self._read_publish(command, body)
        elif kind == PUBACK_COMMAND:
            rc = self._read_puback(body)
        elif kind == PUBREC_COMMAND and len(body) > 2 and body[2] >= 0x80:
            # A refusal paho ignores (it sends PUBREL, then reports the PUBCOMP's success).
            mid = (body[0] << 8) | body[1]
            self.pubrec_refused[mid] = ReasonCode(PacketTypes.PUBREC, identifier=body[2])
        if rc is not None:
            return rc
        self._in_packet = {
            "command": command,
            "have_remaining": 1,
            "remaining_count": list(length_bytes),
            "remaining_mult": 128 ** len(length_bytes),
            "remaining_length": len(body),
            "packet": bytearray(body),
            "to_process": 0,
            "pos": 0,
        }
        try:
            return self._packet_handle()
        except _MALFORMED as exc:
            self._easy_log(mqtt.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)
            return MQTTErrorCode.MQTT_ERR_PROTOCOL
        finally:
            self._in_packet = _empty_in_packet()

    def _sock_send(self, buf: bytes | bytearray) -> int:
        if self._sock is None:
            raise ConnectionError("self._sock is None")
        self._wbuf.append(buf)  # paho passes a fresh slice of its packet: no copy needed
        return len(buf)

    def loop_write(self) -> MQTTErrorCode:
        on_publish, self._on_publish = self._on_publish, None
        try:
            rc = super().loop_write()
        finally:
            self._on_publish = on_publish
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or not self._wbuf:
            return rc
        return self._flush()

    def _flush(self) -> MQTTErrorCode:
        sock = self._sock
        if sock is None:
            self._wbuf = []
            return MQTTErrorCode.MQTT_ERR_NO_CONN
        data = self._wbuf[0] if len(self._wbuf) == 1 else b"".join(self._wbuf)
        try:
            sent = sock.send(data)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0
        except OSError as e:
            log.debug("mqtt: send failed: %s", e)
            self._wbuf = []
            return self._loop_rc_handle(MQTTErrorCode.MQTT_ERR_CONN_LOST)
        self._wbuf = [data[sent:]] if sent < len(data) else []
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def want_write(self) -> bool:
        return bool(self._wbuf) or super().want_write()

    def publish_fast(
        self, topic: str, payload: bytes, qos: int, retain: bool, properties: Properties | None
    ) -> tuple[MQTTErrorCode, int]:
        """`(rc, mid)`, mid 0 for QoS 0; QoS 2 is paho's `publish`. Raises ValueError where
        paho's `publish` would (a wildcard or empty topic, sizes over the protocol's limits)."""
        if qos not in (0, 1):
            return self._publish_paho(topic, payload, qos, retain, properties)
        if self._sock is None:
            return MQTTErrorCode.MQTT_ERR_NO_CONN, 0
        name16 = self._topics.get(topic)
        if name16 is None:
            name16 = self._topics[topic] = topic_field(topic)
        mid = 0
        if qos:
            mid = self._mid_generate()
            while mid in self._fast_inflight or mid in self._out_messages:
                mid = self._mid_generate()  # never endless: the window is under 65535
        packed_properties = b""
        if self._protocol == MQTTProtocolVersion.MQTTv5:
            packed_properties = b"\x00" if properties is None else properties.pack()  # type: ignore[no-untyped-call]
        length = len(name16) + (2 if qos else 0) + len(packed_properties) + len(payload)
        if length > 268435455:
            raise ValueError("payload too large for one MQTT packet")
        # paho's own length packer, as its `_send_publish` uses it.
        packet = bytearray((PUBLISH_COMMAND | qos << 1 | int(retain),))
        self._pack_remaining_length(packet, length)
        packet += name16
        if qos:
            packet += struct.pack("!H", mid)
        packet += packed_properties
        packet += payload
        self._write_packet(PUBLISH_COMMAND, packet, mid, qos)
        if qos:
            self._fast_inflight.add(mid)
        return MQTTErrorCode.MQTT_ERR_SUCCESS, mid

    def puback_fast(self, mid: int) -> None:
        """paho's `ack(mid, 1)` (manual acknowledgements): the same four bytes, written
        without paho's per-packet bookkeeping."""
        self._write_packet(PUBACK_COMMAND, struct.pack("!BBH", PUBACK_COMMAND, 2, mid), mid, 1)

    def _write_packet(self, command: int, packet: bytes | bytearray, mid: int, qos: int) -> None:
        """In call order with paho's own packets: behind those queued (through paho's queue),
        else straight into the write buffer, which is what paho's queue would do with it."""
        if self._out_packet:
            info = _WRITTEN if command == PUBLISH_COMMAND else None
            self._packet_queue(command, packet, mid, qos, info)
        else:
            self._wbuf.append(packet)

    def _read_puback(self, body: bytes | bytearray) -> MQTTErrorCode | None:
        """A PUBACK of a `publish_fast` message (reported to `acknowledged`), or a plain
        success PUBACK of one of paho's; None: paho reads it."""
        if len(body) < 2:
            return None
        mid = (body[0] << 8) | body[1]
        plain = len(body) == 2 or (len(body) == 3 and body[2] == 0)
        if mid in self._fast_inflight:
            self._fast_inflight.discard(mid)
            if plain:
                reason = _PUBACK_SUCCESS
            else:  # a refusal (or properties): paho's reading, errors included
                reason = ReasonCode(PacketTypes.PUBACK, identifier=body[2])
            self.acknowledged(mid, reason)
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        if not plain:
            return None
        with self._out_message_mutex:
            if mid in self._out_messages:
                return self._do_on_publish(mid, _PUBACK_SUCCESS, _NO_PROPERTIES)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _read_publish(self, command: int, body: bytes | bytearray) -> MQTTErrorCode | None:
        """A QoS 0/1 PUBLISH `parse_publish` reads, handed to `deliver` (and acknowledged
        unless acknowledgements are manual); None: paho reads it."""
        qos = (command & 0x06) >> 1
        parsed = parse_publish(body, qos, self._protocol == MQTTProtocolVersion.MQTTv5)
        if parsed is None:
            return None
        topic_bytes, mid, properties, payload = parsed
        try:
            topic = topic_bytes.decode("utf-8")
        except UnicodeDecodeError:
            return None  # paho's way with a topic it cannot decode
        self.deliver(
            topic, bytes(payload), qos, mid, bool(command & 0x08), properties, bool(command & 0x01)
        )
        if qos == 0 or self._manual_ack:
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return self._send_puback(mid)

    def _sock_close(self) -> None:
        """Best effort with what is still buffered (a DISCONNECT, say), then close."""
        if self._wbuf and self._sock is not None:
            with contextlib.suppress(OSError, ValueError):
                self._sock.send(b"".join(self._wbuf))
        self._wbuf = []
        self._rbuf = bytearray()  # a part of a packet of this connection is no use to the next
        super()._sock_close()
