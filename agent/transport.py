"""The one owner of the MQTT connection: connect, will and birth, reconnect, publish, acks.

Two named threads and paho's own network thread:

* `mqtt-supervisor` connects, waits while the connection lasts, and reconnects with capped
  exponential backoff and full jitter (paho's built-in reconnect has no jitter, so a fleet of
  boxes would reconnect in lock step after a broker restart). Before every connection attempt
  it sets the will with the next `epoch`, so a late will of an older connection can be told
  apart from the current state.
* `mqtt-publisher` is the only code that calls `publish`: it takes encoded messages from the
  outbox in order and keeps at most `max_inflight` QoS 1/2 messages unacknowledged.
* paho's loop thread (`loop_start`) reads and writes the socket and runs the callbacks.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.config import MqttConfig
from agent.outbox import Outbox, OutMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Incoming:
    """A received message, as the ingress code needs it (paho's object stays inside here)."""

    topic: str
    payload: bytes
    qos: int
    response_topic: str | None = None
    correlation_data: bytes | None = None
    dup: bool = False


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
        self._publisher_stop = threading.Event()
        # In-flight window: at most min(max_inflight, the broker's Receive Maximum) QoS 1/2
        # publishes unacknowledged; the broker would otherwise disconnect us (MQTT 5).
        self._window_cond = threading.Condition()
        self._window_limit = config.max_inflight
        self._window_used = 0
        self._max_qos = 2
        self._pending_lock = threading.Lock()
        # mid -> (publish time, spool id): QoS 1/2 awaiting the broker's acknowledgement
        self._pending: dict[int, tuple[float, int | None]] = {}
        self._early_acks: dict[int, ReasonCode] = {}
        self._qos_warned = False
        self._last_ack_flush = time.monotonic()
        self.reconnects = 0
        self.lost_at: float | None = None  # wall time the last connection was lost
        self.acked = 0
        self.publish_failures = 0
        self.last_error: str | None = None
        self._ack_listeners: list[Callable[[float], None]] = []
        self._client = self._make_client(client_id)
        self._supervisor = threading.Thread(
            target=self._supervise, name="mqtt-supervisor", daemon=True
        )
        self._publisher = threading.Thread(
            target=self._publish_loop, name="mqtt-publisher", daemon=True
        )

    # -- setup ---------------------------------------------------------------------------

    def _make_client(self, client_id: str) -> mqtt.Client:
        config = self._config
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=MQTTProtocolVersion.MQTTv5 if self.mqtt5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if self.mqtt5 else False,
            reconnect_on_failure=False,  # the supervisor owns reconnects (jitter, epoch, will)
            # A request is acknowledged only after the handler stored it (see _handle_message).
            manual_ack=True,
        )
        client.max_inflight_messages_set(config.max_inflight)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_message = self._handle_message
        client.on_publish = self._handle_publish
        client.on_socket_open = self._handle_socket_open
        client.on_pre_connect = self._handle_pre_connect
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
        self._supervisor.start()
        self._publisher.start()

    # -- supervisor ----------------------------------------------------------------------

    def _supervise(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            started = time.monotonic()
            if self._connect_once():
                # Wait while the connection lasts; a publish the broker never acknowledges
                # is retried over a fresh connection (paho resends unacknowledged ones).
                while not self._stop.is_set() and not self._disconnected.wait(0.25):
                    self._check_ack_timeout()
            with contextlib.suppress(Exception):
                self._client.loop_stop()
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
        self._client.loop_start()
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
        with self._pending_lock:
            self._pending.clear()
            self._early_acks.clear()
        with self._window_cond:
            self._window_used = 0
            self._window_cond.notify_all()
        self._client = client
        try:
            self._on_new_session(self.lost_at)
        except Exception:
            log.exception("mqtt: on_new_session hook failed")
        return True

    def _check_ack_timeout(self) -> None:
        timeout = self._config.ack_timeout_s
        if timeout <= 0 or not self.connected.is_set():
            return
        with self._pending_lock:
            oldest = min((sent for sent, _ in self._pending.values()), default=None)
        if oldest is not None and time.monotonic() - oldest > timeout:
            self._note_error(f"no acknowledgement for {timeout:.0f} s: reconnecting")
            with self._pending_lock:  # restart the clock for the resent messages
                self._pending = {m: (time.monotonic(), i) for m, (_, i) in self._pending.items()}
            with contextlib.suppress(Exception):
                self._client.disconnect()

    def _note_error(self, message: str) -> None:
        if message != self.last_error:
            log.warning("mqtt: %s", message)
        self.last_error = message

    # -- paho callbacks (paho's thread) ---------------------------------------------------

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
        with self._window_cond:
            self._window_limit = min(self._config.max_inflight, receive_max or 65535)
            self._window_cond.notify_all()
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

    def _handle_message(
        self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage
    ) -> None:
        response_topic = correlation = None
        props = getattr(message, "properties", None)
        if self.mqtt5 and props is not None:
            response_topic = getattr(props, "ResponseTopic", None)
            correlation = getattr(props, "CorrelationData", None)
        incoming = Incoming(
            topic=message.topic,
            payload=bytes(message.payload),
            qos=message.qos,
            response_topic=response_topic,
            correlation_data=correlation,
            dup=bool(message.dup),
        )
        try:
            self._on_message(incoming)
        except Exception:
            # One failing handler never stops the network loop.
            log.exception("mqtt: message handler failed for topic %s", message.topic[:200])
        # The handler stored what it accepted before returning: only now may the broker
        # forget the message (a crash before this line means a redelivery, not a loss).
        if message.qos > 0:
            client.ack(message.mid, message.qos)

    def _handle_publish(
        self,
        client: mqtt.Client,
        userdata: Any,
        mid: int,
        reason: ReasonCode,
        properties: Properties | None,
    ) -> None:
        with self._pending_lock:
            pending = self._pending.pop(mid, None)
            if pending is None:
                self._early_acks[mid] = reason
                return
        self._acknowledged(pending[0], pending[1], reason)

    def _acknowledged(self, sent: float, spool_id: int | None, reason: ReasonCode) -> None:
        with self._window_cond:
            self._window_used -= 1
            self._window_cond.notify()
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

    # -- publisher -----------------------------------------------------------------------

    def _publish_loop(self) -> None:
        while not self._publisher_stop.is_set():
            message = self._outbox.get(timeout=0.02)
            now = time.monotonic()
            if message is None or now - self._last_ack_flush > 0.02:
                self._last_ack_flush = now
                self._outbox.flush_acks()
            if message is None:
                if len(self._outbox) == 0 and self._stop.is_set():
                    return
                continue
            if not self._wait_connected():
                self._outbox.unget(message)
                return
            self._publish(message)

    def _wait_connected(self) -> bool:
        while not self.connected.wait(0.25):
            if self._publisher_stop.is_set():
                return False
        return True

    def _publish(self, message: OutMessage) -> None:
        qos = message.qos
        if qos > self._max_qos:
            if not self._qos_warned:
                log.warning(
                    "mqtt: the broker refuses QoS %d; publishing at QoS %d", qos, self._max_qos
                )
                self._qos_warned = True
            qos = self._max_qos
        if qos > 0 and not self._acquire_window():
            self._outbox.unget(message)
            return
        sent = time.monotonic()
        try:
            info = self._client.publish(
                message.topic, message.payload, qos, message.retain, message.properties
            )
        except (ValueError, TypeError) as e:
            log.error("mqtt: cannot publish to %s: %s", message.topic[:200], e)
            if qos > 0:
                self._acknowledged(
                    sent, message.spool_id, ReasonCode(PacketTypes.PUBACK, "Unspecified error")
                )
            return
        if qos == 0:
            if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN:
                self._outbox.unget(message)  # lost the connection just now: send it later
            elif message.spool_id is not None:
                self._outbox.acknowledged(message.spool_id)  # downgraded to QoS 0: sent is all
            return
        # QoS 1/2: paho keeps it (and resends it after a reconnect) until the broker acks.
        with self._pending_lock:
            reason = self._early_acks.pop(info.mid, None)
            if reason is None:
                self._pending[info.mid] = (sent, message.spool_id)
        if reason is not None:
            self._acknowledged(sent, message.spool_id, reason)

    def _acquire_window(self) -> bool:
        with self._window_cond:
            while self._window_used >= self._window_limit:
                if self._publisher_stop.is_set():
                    return False
                self._window_cond.wait(0.25)
            self._window_used += 1
            return True

    def thread_problem(self) -> str | None:
        """Which of the connection's threads died, if any (for the systemd watchdog).

        The supervisor reconnects, the publisher drains the outbox, paho's loop thread moves
        bytes while connected; a broker outage is not a problem, a dead thread is.
        """
        for thread in (self._supervisor, self._publisher):
            if thread.ident is not None and not thread.is_alive():
                return f"the {thread.name} thread died"
        loop = getattr(self._client, "_thread", None)  # paho keeps its loop thread here
        if self.connected.is_set() and isinstance(loop, threading.Thread) and not loop.is_alive():
            return "paho's network loop thread died while connected"
        return None

    @property
    def window_limit(self) -> int:
        """QoS 1/2 publishes allowed unacknowledged now (after the broker's Receive Maximum)."""
        return self._window_limit

    @property
    def inflight(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    # -- stop ----------------------------------------------------------------------------

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
        """Publish `final` (the offline status), flush, disconnect cleanly, join the threads."""
        if final is not None and self.connected.is_set():
            with contextlib.suppress(Exception):
                self._outbox.put(final, timeout=timeout)
            self.flush(timeout)
        self._stop.set()
        self._outbox.close()
        self._publisher_stop.set()
        self._publisher.join(timeout) if self._publisher.is_alive() else None
        with contextlib.suppress(Exception):
            self._client.disconnect()
        self._supervisor.join(timeout) if self._supervisor.is_alive() else None
        with contextlib.suppress(Exception):
            self._client.loop_stop()
