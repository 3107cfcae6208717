"""The one owner of the MQTT connection: connect, will and birth, reconnect, publish, acks.

paho is driven through its external-loop API (`loop_read`, `loop_write`, `loop_misc` around a
selector), never `loop_start`, and only by the holder of one lock, the io lock:

* the `mqtt-io` thread holds it except while it waits in `select`. It connects, and
  reconnects with capped exponential backoff and full jitter (paho's built-in reconnect has no
  jitter, so a fleet of boxes would reconnect in lock step after a broker restart); before
  every attempt it sets the will with the next `epoch`, so a late will of an older connection
  can be told apart from the current state. It reads the socket and runs paho's callbacks
  (incoming requests, acknowledgements), and publishes what the outbox holds.
* a thread that queued a message (a worker with a chunk, the spool writer with a request's
  acknowledgement) takes the lock when it is free and publishes from there: the chunk reaches
  the socket with no hand-off. Whoever holds the lock takes the outbox in order, a batch at a
  time, keeps at most `max_inflight` QoS 1/2 messages unacknowledged and writes the batch with
  one `loop_write`; every holder looks at the outbox again after releasing the lock, so
  nothing queued meanwhile is left behind.

Why not paho's own thread: with `loop_start`, every publish from another thread is a hand-off
(a wake-up byte, a `select`, a thread switch, a GIL hand-over) per message. One lock also
keeps per-stream order (the outbox is FIFO) and frees the in-flight window from locks.
"""

from __future__ import annotations

import contextlib
import logging
import random
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.config import MqttConfig
from agent.delivery.outbox import Outbox, OutMessage

if TYPE_CHECKING:
    from paho.mqtt.client import _InPacket

log = logging.getLogger(__name__)


PUBLISH_BATCH = 256  # messages taken from the outbox and written with one loop_write
MISC_S = 0.5  # keepalive, acknowledgement timeout and CONNACK deadline checks
CONNECT_TIMEOUT_S = 10.0  # TCP connect, TLS handshake and CONNACK


_PUBACK_SUCCESS = ReasonCode(PacketTypes.PUBACK)  # "Success"; read, never changed
_NO_PROPERTIES = Properties(PacketTypes.PUBACK)  # type: ignore[no-untyped-call]
PUBLISH_COMMAND = 0x30
PUBACK_COMMAND = 0x40
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


def _topic_field(topic: str) -> bytes:
    """A PUBLISH's topic as its packet carries it (two length bytes, UTF-8), as paho's
    `_pack_str16` packs it; ValueError where paho's `publish` refuses the topic."""
    name = topic.encode("utf-8")
    if not name or b"+" in name or b"#" in name or len(name) > 65535:
        raise ValueError(f"invalid publish topic {topic[:200]!r}")
    return struct.pack("!H", len(name)) + name


class _TopicCache(dict[str, bytes]):
    """`_topic_field`s of recent topics, bounded: emptied when full (a request's reply topic
    is used by its messages only; a stream's by many in a row)."""

    LIMIT = 1024

    def __setitem__(self, topic: str, field: bytes) -> None:
        if len(self) >= self.LIMIT:
            self.clear()
        super().__setitem__(topic, field)


def _no_delivery(
    topic: str, payload: bytes, qos: int, mid: int, dup: bool, props: RequestProperties | None
) -> None:
    """`_Client.deliver` until a transport sets its own."""


def _no_acknowledgement(mid: int, reason: ReasonCode) -> None:
    """`_Client.acknowledged` until a transport sets its own."""


class _Client(mqtt.Client):
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
    for every PUBACK it reads. The agent needs the callback only for acknowledgements, so it
    is out of the way while `loop_write` runs; and a plain success PUBACK (two bytes, or a
    zero reason code without properties: what Mosquitto sends) is answered with one shared
    success ReasonCode and empty Properties. Likewise an MQTT 5 PUBLISH at QoS 0 or 1 whose
    properties are at most a response topic and correlation data (what requests carry) is
    read without a Properties object: 2 µs instead of 12 µs per request. Anything else
    (QoS 2, other properties, a malformed packet) takes paho's way, with its errors.

    Those PUBLISHes also go to `deliver` (set by the transport) directly, and a QoS 0/1
    publish is written by `publish_fast`: paho would build an MQTTMessage for each, with an
    MQTTMessageInfo and its `threading.Condition`, match the topic against its callback
    filters and take two callback locks (a publish: 8.9 µs against 4.9 µs in a hot loop).
    The packet is the same and is written in call order with paho's own packets (straight
    into the write buffer when paho's queue is empty, else through that queue); its PUBACK is
    matched here and reported to `acknowledged`.
    """

    READ_SIZE = 65536

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rbuf = bytearray()  # the start of a packet whose rest has not arrived yet
        self._wbuf: list[bytes | bytearray] = []
        self._fast_inflight: set[int] = set()  # QoS 1 ids from `publish_fast`, unacknowledged
        # Topic -> its checked, length-prefixed bytes: a stream publishes many messages to one.
        self._topics: _TopicCache = _TopicCache()
        # (topic, payload, qos, mid, dup, properties) of a PUBLISH read by the fast path.
        self.deliver: Callable[[str, bytes, int, int, bool, RequestProperties | None], None]
        self.deliver = _no_delivery
        # (mid, reason code) of the PUBACK of a `publish_fast` message, set by the transport.
        self.acknowledged: Callable[[int, ReasonCode], None] = _no_acknowledgement

    def unsent(self) -> int:
        """Bytes written by paho that the socket has not taken yet."""
        return sum(len(chunk) for chunk in self._wbuf)

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        """One `recv` of whatever the socket holds, and every complete packet in it, framed
        here; the start of a packet whose rest has not arrived waits for the next call.
        paho's reader takes three calls and a dict of state per packet (its type byte, its
        length, its body), and handles as many packets per call as its books hold messages
        (those of `publish_fast` are not in them). Each packet goes to paho's handler as paho
        would pass it, except the PUBLISH and PUBACK packets of the fast paths."""
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
        with self._msgtime_mutex:
            self._last_bytes_received = mqtt.time_func()
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
        except MalformedPacket as exc:
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
        """`publish` for QoS 0 and 1: `(rc, mid)`. Raises ValueError where paho's `publish`
        would (a wildcard or empty topic, sizes over the protocol's limits)."""
        if qos not in (0, 1):
            raise ValueError("publish_fast takes QoS 0 or 1")
        if self._sock is None:
            return MQTTErrorCode.MQTT_ERR_NO_CONN, 0
        name16 = self._topics.get(topic)
        if name16 is None:
            name16 = self._topics[topic] = _topic_field(topic)
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
        self.deliver(topic, bytes(payload), qos, mid, bool(command & 0x08), properties)
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


@dataclass(frozen=True)
class RequestProperties:
    """The MQTT 5 PUBLISH properties a request may carry, as paho's Properties names them."""

    ResponseTopic: str | None = None  # paho's attribute names
    CorrelationData: bytes | None = None


_RESPONSE_TOPIC, _CORRELATION_DATA = 0x08, 0x09


def parse_publish(
    packet: bytes | bytearray, qos: int, mqtt5: bool = True
) -> tuple[bytes, int, RequestProperties | None, bytes | bytearray] | None:
    """`(topic, mid, properties, payload)` of a PUBLISH body (after the fixed header): MQTT
    3.1.1, or MQTT 5 with at most one response topic and one correlation data as properties;
    None for any other (paho decodes those, and reports what is malformed)."""
    try:
        end_topic = 2 + ((packet[0] << 8) | packet[1])
        if end_topic > len(packet):
            return None
        topic = bytes(packet[2:end_topic])
        pos, mid = end_topic, 0
        if qos:
            if pos + 2 > len(packet):
                return None
            mid = (packet[pos] << 8) | packet[pos + 1]
            pos += 2
        if not mqtt5:
            return topic, mid, None, packet[pos:]
        length = shift = 0
        for _ in range(4):  # the properties' length: a variable byte integer
            byte = packet[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        else:
            return None
        end = pos + length
        if end > len(packet):
            return None
        if not length:
            return topic, mid, None, packet[end:]
        response_topic: str | None = None
        correlation: bytes | None = None
        while pos < end:
            ident = packet[pos]
            size = (packet[pos + 1] << 8) | packet[pos + 2]
            value = bytes(packet[pos + 3 : pos + 3 + size])
            pos += 3 + size
            if len(value) != size:
                return None
            if ident == _RESPONSE_TOPIC and response_topic is None:
                response_topic = value.decode("utf-8")
                if "\0" in response_topic:
                    return None
            elif ident == _CORRELATION_DATA and correlation is None:
                correlation = value
            else:
                return None
        if pos != end:
            return None
        return topic, mid, RequestProperties(response_topic, correlation), packet[end:]
    except (IndexError, UnicodeDecodeError):
        return None


@dataclass
class Incoming:
    """A received message, as the ingress code needs it (paho's object stays inside here).

    `deferred` is set when the handler took over the acknowledgement of a QoS 1/2 message
    (`Transport.defer`); otherwise the transport acknowledges it as soon as the handler
    returns.
    """

    topic: str
    payload: bytes
    qos: int
    response_topic: str | None = None
    correlation_data: bytes | None = None
    dup: bool = False
    mid: int = 0
    deferred: bool = False


class EpochStore:
    """A counter on disk that grows with every connection, across restarts and power cuts.

    A wall clock would not do: a Jetson without an RTC battery boots in 1970 until NTP runs.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            self._value = int(path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            self._value = 0

    @property
    def value(self) -> int:
        return self._value

    def next(self) -> int:
        return self._value + 1

    def commit(self, value: int) -> None:
        self._value = value
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(f"{value}\n")
        tmp.replace(self._path)


def backoff_delays(min_s: float, max_s: float, rng: random.Random) -> Callable[[int], float]:
    """Full jitter: attempt n waits uniformly in [min_s, min(max_s, min_s * 2**n)]."""

    def delay(attempt: int) -> float:
        ceiling = min(max_s, min_s * (2 ** min(attempt, 30)))
        return rng.uniform(min_s, max(min_s, ceiling))

    return delay


def read_secret(path: Path) -> str:
    """A password from a file (or systemd's credentials folder); the value is never logged."""
    try:
        return path.read_text().rstrip("\r\n")
    except OSError as e:
        raise ConnectionError(f"cannot read password file {path}: {e.strerror}") from None


class Transport:
    """MQTT connection for the agent. `start()`, then `close()`; thread-safe otherwise."""

    def __init__(
        self,
        config: MqttConfig,
        *,
        client_id: str,
        outbox: Outbox,
        on_message: Callable[[Incoming], None],
        subscriptions: Sequence[tuple[str, int]],
        will: Callable[[int], OutMessage],
        on_connected: Callable[[int], None],
        epoch: EpochStore,
        on_new_session: Callable[[float | None], None] = lambda lost_at: None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._outbox = outbox
        self._on_message = on_message
        self._subscriptions = list(subscriptions)
        self._will = will
        self._on_connected_hook = on_connected
        self._on_new_session = on_new_session
        self._client_id = client_id
        self._used = False  # the current client object has tried to connect
        self._epoch = epoch
        self._delay = backoff_delays(
            config.reconnect_min_s, config.reconnect_max_s, rng or random.Random()
        )
        self.mqtt5 = config.protocol == "5"
        self.connected = threading.Event()
        self._disconnected = threading.Event()
        self._stop = threading.Event()
        # Everything below is touched only under the io lock (other threads read counts).
        # In-flight window: at most min(max_inflight, the broker's Receive Maximum) QoS 1/2
        # publishes unacknowledged; the broker would otherwise disconnect us (MQTT 5).
        self._window_limit = config.max_inflight
        self._max_qos = 2
        # mid -> (publish time, spool id): QoS 1/2 awaiting the broker's acknowledgement
        self._pending: dict[int, tuple[float, int | None]] = {}
        self._qos_warned = False
        self._connection = 0  # counts connections: a deferred ack belongs to one
        self._acks_lock = threading.Lock()
        self._deferred_acks: list[tuple[int, int, int]] = []  # (connection, mid, qos)
        self.reconnects = 0
        self.lost_at: float | None = None  # wall time the last connection was lost
        self.acked = 0
        self.publish_failures = 0
        self.last_error: str | None = None
        self._ack_listeners: list[Callable[[float], None]] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Held by whoever drives paho: the io thread except while it waits in select, or a
        # thread that just queued a message and publishes it itself (`_on_queued`).
        self._io_lock = threading.Lock()
        outbox.set_on_queued(self._on_queued)
        self._client = self._make_client(client_id)
        self._thread = threading.Thread(target=self._run, name="mqtt-io", daemon=True)

    # -- setup ---------------------------------------------------------------------------

    def _make_client(self, client_id: str) -> _Client:
        config = self._config
        client = _Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=MQTTProtocolVersion.MQTTv5 if self.mqtt5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if self.mqtt5 else False,
            reconnect_on_failure=False,  # this class owns reconnects (jitter, epoch, will)
            # A request is acknowledged only after it is stored (see `defer`).
            manual_ack=True,
        )
        client.max_inflight_messages_set(config.max_inflight)
        client.connect_timeout = CONNECT_TIMEOUT_S
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_message = self._handle_message
        client.deliver = self._deliver
        client.acknowledged = self._acknowledged
        client.on_publish = self._handle_publish
        client.on_socket_open = self._handle_socket_open
        client.on_pre_connect = self._handle_pre_connect
        # Publishes are only queued; the io lock's holder writes a batch with one loop_write.
        client.on_socket_register_write = _ignore_socket
        if config.username is not None:
            password = read_secret(config.password_file) if config.password_file else None
            client.username_pw_set(config.username, password)
        if config.tls.enabled:
            context = ssl.create_default_context(
                cafile=str(config.tls.ca_file) if config.tls.ca_file else None
            )
            if config.tls.cert_file:
                context.load_cert_chain(
                    str(config.tls.cert_file),
                    str(config.tls.key_file) if config.tls.key_file else None,
                )
            context.check_hostname = config.tls.check_hostname
            client.tls_set_context(context)
        return client

    def add_ack_listener(self, listener: Callable[[float], None]) -> None:
        """Called with the acknowledgement latency (seconds) of every QoS 1/2 publish."""
        self._ack_listeners.append(listener)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Interrupt the io thread's wait (any thread; cheap, never blocks)."""
        with contextlib.suppress(OSError):  # full: a wake-up is already pending
            self._wake_w.send(b"\0")

    def defer(self, incoming: Incoming) -> Callable[[], None]:
        """Take over the acknowledgement of `incoming` (QoS 1/2): the returned function, called
        from any thread once the message is safe, queues it; the caller has it sent (the
        spool writer kicks the outbox once after a batch's callbacks). An acknowledgement that
        comes after its connection was lost is dropped: the broker delivers the message again."""
        incoming.deferred = True
        connection, mid, qos = self._connection, incoming.mid, incoming.qos

        def ack() -> None:
            with self._acks_lock:
                self._deferred_acks.append((connection, mid, qos))

        return ack

    def _on_queued(self) -> None:
        """A message (or an acknowledgement) was queued on this thread: publish it from here
        when nobody drives the connection (the io thread waits in select), so a chunk goes to
        the socket without a hand-off. When the lock is taken, its holder publishes it: every
        holder looks at the outbox again after releasing the lock."""
        while self._io_lock.acquire(blocking=False):
            try:
                client = self._client
                if self._stop.is_set() or client.socket() is None:
                    return
                self._pump(client)
                blocked = client.want_write()
            finally:
                self._io_lock.release()
            if blocked:
                self.wake()  # the socket is full: the io thread waits until it drains
                return
            if not self._work_waiting():
                return

    def _work_waiting(self) -> bool:
        """Something this connection could send now."""
        if self._deferred_acks:
            return True
        if not self.connected.is_set() or len(self._pending) >= self._window_limit:
            return False
        return not self._client.want_write() and self._outbox.has_work()

    # -- the io thread ---------------------------------------------------------------------

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            started = time.monotonic()
            with self._io_lock:  # nobody publishes on a client being replaced or connected
                connected = self._connect_once()
            if connected:
                try:
                    self._serve()
                except Exception:  # a bug must cost the connection, never the thread
                    log.exception("mqtt: the connection loop failed; reconnecting")
            with self._io_lock:
                self._drop_connection()
            if self._stop.is_set():
                break
            attempt = 0 if time.monotonic() - started > 60 else attempt + 1
            delay = self._delay(attempt)
            log.info("mqtt: reconnecting in %.1f s (attempt %d)", delay, attempt)
            self._stop.wait(delay)

    def _connect_once(self) -> bool:
        config = self._config
        self._disconnected.clear()
        if self._used and not self._fresh_client():
            return False
        self._used = True
        self._connection += 1
        properties = None
        if self.mqtt5:
            properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            properties.SessionExpiryInterval = config.session_expiry_s
        try:
            self._client.connect(
                config.host,
                config.port,
                keepalive=config.keepalive_s,
                clean_start=False if self.mqtt5 else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
                properties=properties,
            )
        except (OSError, ssl.SSLError, ValueError) as e:
            self._note_error(f"cannot connect to {config.host}:{config.port}: {e}")
            return False
        return True

    def _fresh_client(self) -> bool:
        """A new paho client for every connection: the spool, not paho's memory, is the
        session. Whatever was in flight on the old connection is read back from the spool
        and published again in order (paho's own resend after a reconnect is bypassed)."""
        try:
            client = self._make_client(self._client_id)
        except ConnectionError as e:
            self._note_error(str(e))
            return False
        self._pending.clear()
        self._client = client
        try:
            self._on_new_session(self.lost_at)
        except Exception:
            log.exception("mqtt: on_new_session hook failed")
        return True

    def _serve(self) -> None:
        """One connection: publish, read, write, keep alive, until it ends or we stop. The io
        lock is held throughout, except while waiting in select."""
        client = self._client
        sock = client.socket()
        if sock is None:
            return
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        selector.register(sock, selectors.EVENT_READ)
        watching_write = False
        connect_deadline = time.monotonic() + CONNECT_TIMEOUT_S
        next_misc = time.monotonic() + MISC_S
        pending_tls = getattr(sock, "pending", None)
        self._io_lock.acquire()
        try:
            while not self._stop.is_set() and not self._disconnected.is_set():
                busy = self._pump(client)
                if client.socket() is None:
                    break  # lost while writing: paho called on_disconnect
                wants_write = client.want_write()  # the socket took only part of it
                if wants_write != watching_write:
                    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
                    selector.modify(sock, events)
                    watching_write = wants_write
                now = time.monotonic()
                if now >= next_misc:
                    next_misc = now + MISC_S
                    if not self._misc(client, now, connect_deadline):
                        break
                tls_buffered = pending_tls is not None and pending_tls() > 0
                self._io_lock.release()
                try:
                    # Looked at after the release: a message queued before it is seen here,
                    # one queued after it is published by the thread that queued it.
                    idle = not (busy or tls_buffered or self._work_waiting())
                    ready = selector.select(max(0.0, next_misc - now) if idle else 0.0)
                finally:
                    self._io_lock.acquire()
                readable = tls_buffered
                for key, mask in ready:
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                        continue
                    readable = readable or bool(mask & selectors.EVENT_READ)
                    if mask & selectors.EVENT_WRITE and client.loop_write():
                        return  # connection lost: paho called on_disconnect
                if readable and client.loop_read():
                    return
        finally:
            self._io_lock.release()
            selector.close()

    def _pump(self, client: _Client) -> bool:
        """Under the io lock: deferred acknowledgements, then the outbox up to the window,
        written with one loop_write. True when more messages may be waiting."""
        self._send_deferred_acks(client)
        busy = self.connected.is_set() and self._publish_batch(client)
        if client.want_write():
            client.loop_write()  # a lost connection shows as on_disconnect
        return busy

    def _misc(self, client: mqtt.Client, now: float, connect_deadline: float) -> bool:
        """Keepalive (paho's loop_misc), the CONNACK deadline, acknowledgement timeouts."""
        if not self.connected.is_set() and now > connect_deadline:
            self._note_error(f"no CONNACK within {CONNECT_TIMEOUT_S:.0f} s")
            return False
        if client.loop_misc() != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return False
        timeout = self._config.ack_timeout_s
        if timeout > 0 and self.connected.is_set() and self._pending:
            oldest = min(sent for sent, _ in self._pending.values())
            if now - oldest > timeout:
                self._note_error(f"no acknowledgement for {timeout:.0f} s: reconnecting")
                return False
        return True

    def _drop_connection(self) -> None:
        """End the current connection, cleanly if it is still up (DISCONNECT, then close)."""
        client = self._client
        if client.socket() is None:
            self.connected.clear()
            return
        with contextlib.suppress(Exception):
            client.disconnect()
            client.loop_write()
        with contextlib.suppress(Exception):
            sock = client.socket()
            if sock is not None:
                sock.close()
        self.connected.clear()

    def _send_deferred_acks(self, client: _Client) -> None:
        if not self._deferred_acks:
            return
        with self._acks_lock:
            acks, self._deferred_acks = self._deferred_acks, []
        for connection, mid, qos in acks:
            if connection != self._connection:
                continue  # the broker delivers it again on the new connection
            if qos == 1:
                client.puback_fast(mid)
            else:
                client.ack(mid, qos)

    def _note_error(self, message: str) -> None:
        if message != self.last_error:
            log.warning("mqtt: %s", message)
        self.last_error = message

    # -- publishing (under the io lock) ----------------------------------------------------

    def _publish_batch(self, client: _Client) -> bool:
        """Publish what the outbox holds, up to the window; True when more may be waiting."""
        room = self._window_limit - len(self._pending)
        if room <= 0 or client.want_write():
            # The window is full, or the socket has not taken the last write yet: messages
            # stay in the outbox, whose bound pushes back on the producers (QoS 0 has no
            # window, so a stalled broker would otherwise grow paho's buffer without end).
            return False
        messages = self._outbox.take(min(PUBLISH_BATCH, room))
        if not messages:
            return False
        for n, message in enumerate(messages):
            if not self._publish(client, message):
                for back in reversed(messages[n:]):
                    self._outbox.unget(back)
                return False
        return True

    def _publish(self, client: _Client, message: OutMessage) -> bool:
        """False when the connection is gone (the message goes back to the outbox)."""
        qos = message.qos
        if qos > self._max_qos:
            if not self._qos_warned:
                log.warning(
                    "mqtt: the broker refuses QoS %d; publishing at QoS %d", qos, self._max_qos
                )
                self._qos_warned = True
            qos = self._max_qos
        sent = time.monotonic()
        try:
            if qos < 2:
                rc, mid = client.publish_fast(
                    message.topic, message.payload, qos, message.retain, message.properties
                )
            else:
                info = client.publish(
                    message.topic, message.payload, qos, message.retain, message.properties
                )
                rc, mid = info.rc, info.mid
        except (ValueError, TypeError) as e:
            log.error("mqtt: cannot publish to %s: %s", message.topic[:200], e)
            self.publish_failures += 1
            if message.spool_id is not None:
                self._outbox.acknowledged(message.spool_id)  # forgotten: it can never go out
            return True
        if rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
            return False
        if qos == 0:
            if message.spool_id is not None:
                self._outbox.acknowledged(message.spool_id)  # downgraded to QoS 0: sent is all
        else:
            # Acknowledgements are read by this thread only after this returns: no race.
            self._pending[mid] = (sent, message.spool_id)
        return True

    # -- paho callbacks (under the io lock) ------------------------------------------------

    def _handle_pre_connect(self, client: mqtt.Client, userdata: Any) -> None:
        message = self._will(self._epoch.next())
        client.will_set(message.topic, message.payload, message.qos, message.retain)

    def _handle_socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        if self._config.tcp_nodelay:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _handle_connect(
        self,
        client: mqtt.Client,
        userdata: Any,
        flags: mqtt.ConnectFlags,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        if reason.is_failure:
            # Never mark a refused connection as connected: a wrong password is a retry.
            self._note_error(f"broker refused the connection: {reason}")
            self._disconnected.set()
            return
        epoch = self._epoch.next()
        self._epoch.commit(epoch)
        self._apply_broker_limits(properties)
        if self.reconnects or self.connected.is_set():
            log.info("mqtt: reconnected (epoch %d)", epoch)
        else:
            log.info(
                "mqtt: connected to %s:%d (epoch %d)", self._config.host, self._config.port, epoch
            )
        self.last_error = None
        if self._subscriptions:
            client.subscribe(self._subscriptions)
        try:
            self._on_connected_hook(epoch)
        except Exception:
            log.exception("mqtt: on_connected hook failed")
        self.connected.set()

    def _apply_broker_limits(self, properties: Properties | None) -> None:
        """Receive Maximum bounds the in-flight window; Maximum QoS caps what we publish."""
        receive_max = getattr(properties, "ReceiveMaximum", None) if properties else None
        max_qos = getattr(properties, "MaximumQoS", None) if properties else None
        self._window_limit = min(self._config.max_inflight, receive_max or 65535)
        self._max_qos = 2 if max_qos is None else int(max_qos)
        if self._max_qos < 2:
            log.info("mqtt: the broker accepts QoS <= %d", self._max_qos)

    def _handle_disconnect(
        self,
        client: mqtt.Client,
        userdata: Any,
        flags: mqtt.DisconnectFlags,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        was_connected = self.connected.is_set()
        self.connected.clear()
        if was_connected:
            self.reconnects += 1
            self.lost_at = time.time()
            if not self._stop.is_set():
                self._note_error(f"connection lost: {reason}")
        elif not self._stop.is_set() and self.last_error is None:
            # Closed before CONNACK: a refused TLS client certificate looks like this.
            self._note_error(f"the broker closed the connection before accepting it: {reason}")
        self._disconnected.set()
        self.wake()  # noticed on another thread: the io thread may be waiting in select

    def _handle_message(
        self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage
    ) -> None:
        """paho's way in: QoS 2, other properties, what the fast path leaves to paho."""
        self._deliver(
            message.topic,
            bytes(message.payload),
            message.qos,
            message.mid,
            bool(message.dup),
            getattr(message, "properties", None) if self.mqtt5 else None,
        )

    def _deliver(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        mid: int,
        dup: bool,
        props: RequestProperties | Properties | None,
    ) -> None:
        """A received message, from `_Client`'s fast path or from paho (under the io lock)."""
        incoming = Incoming(
            topic=topic,
            payload=payload,
            qos=qos,
            response_topic=getattr(props, "ResponseTopic", None),
            correlation_data=getattr(props, "CorrelationData", None),
            dup=dup,
            mid=mid,
        )
        try:
            self._on_message(incoming)
        except Exception:
            # One failing handler never stops the network loop.
            log.exception("mqtt: message handler failed for topic %s", topic[:200])
        # Unless the handler took it over (a request acknowledged once stored), the broker
        # may forget the message now (a crash before this line means a redelivery, no loss).
        if qos > 0 and not incoming.deferred:
            self._client.ack(mid, qos)

    def _handle_publish(
        self,
        client: mqtt.Client,
        userdata: Any,
        mid: int,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        """paho's on_publish: the PUBACK (or PUBCOMP) of a message `publish` wrote."""
        self._acknowledged(mid, reason)

    def _acknowledged(self, mid: int, reason: ReasonCode) -> None:
        pending = self._pending.pop(mid, None)
        if pending is None:
            return  # a QoS 0 publish written to the socket: nothing to settle
        sent, spool_id = pending
        if spool_id is not None:
            # Refused publishes are forgotten too: resending what the broker refuses (not
            # authorized, quota) would only loop; they are counted and logged.
            self._outbox.acknowledged(spool_id)
        if reason.is_failure:
            self.publish_failures += 1
            log.warning("mqtt: broker refused a publish: %s", reason)
            return
        self.acked += 1
        latency = time.monotonic() - sent
        for listener in self._ack_listeners:
            listener(latency)

    # -- health and stop -------------------------------------------------------------------

    def thread_problem(self) -> str | None:
        """Whether the connection's thread died (for the systemd watchdog). A broker outage
        is not a problem (the thread reconnects and the outbox spools); a dead thread is."""
        if self._thread.ident is not None and not self._thread.is_alive():
            return f"the {self._thread.name} thread died"
        return None

    @property
    def window_limit(self) -> int:
        """QoS 1/2 publishes allowed unacknowledged now (after the broker's Receive Maximum)."""
        return self._window_limit

    @property
    def inflight(self) -> int:
        return len(self._pending)

    @property
    def unsent_bytes(self) -> int:
        """Published bytes the socket has not taken yet (a slow or stalled broker)."""
        return self._client.unsent()

    def flush(self, timeout: float) -> bool:
        """Wait until the outbox is empty and every QoS 1/2 publish is acknowledged."""
        deadline = time.monotonic() + timeout
        if not self._outbox.wait_empty(timeout):
            return False
        while self.inflight and time.monotonic() < deadline:
            if not self.connected.is_set():
                return False
            time.sleep(0.01)
        return self.inflight == 0

    def close(self, final: OutMessage | None = None, timeout: float = 5.0) -> None:
        """Publish `final` (the offline status), flush, disconnect cleanly, join the thread,
        then close the outbox (the spool writer writes what it holds)."""
        if final is not None and self.connected.is_set():
            with contextlib.suppress(Exception):
                self._outbox.put(final, timeout=timeout)
            self.flush(timeout)
        self._stop.set()
        self.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._outbox.close()
        self._wake_r.close()
        self._wake_w.close()


def _ignore_socket(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """paho's on_socket_register_write: publishes stay queued until the io loop writes them."""
