"""The one owner of the MQTT connection: connect, will and birth, reconnect, publish, acks.

paho is driven through its external-loop API (`loop_read`, `loop_write`, `loop_misc` around a
selector), never `loop_start`, and only by the holder of one lock, the io lock:

* the `mqtt-io` thread holds it except while it waits in `select`. It connects, and
  reconnects with capped exponential backoff and full jitter (`agent.mqtt.reconnect`);
  before every attempt it sets the will with the next `epoch`, so a late will of an older
  connection can be told apart from the current state. It reads the socket and runs paho's
  callbacks (incoming requests, `agent.mqtt.inbound`; acknowledgements,
  `agent.mqtt.window`), and publishes what the outbox holds.
* a thread that queued a message (a worker with a chunk, the spool writer with a request's
  acknowledgement) takes the lock when it is free and publishes from there: the chunk reaches
  the socket with no hand-off. Whoever holds the lock takes the outbox in order, a batch at a
  time, keeps at most `max_inflight` QoS 1/2 messages unacknowledged and writes the batch with
  one `loop_write`; every holder looks at the outbox again after releasing the lock, so
  nothing queued meanwhile is left behind.
* a worker streaming at QoS 1/2 also reads in its kick (`_drive`), as a lone paho publisher's
  one thread does; the io thread leaves the socket to it until it stops or the window fills.

Why not paho's own thread: with `loop_start`, every publish from another thread is a hand-off
(a wake-up, a thread switch, a GIL hand-over) per message. One lock also keeps per-stream
order (the outbox is FIFO) and frees the in-flight window from locks.

The client (`agent.mqtt.paho_fast.new_client`: fast, or paho's own) is used by its interface.
"""

from __future__ import annotations

import contextlib
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.config import MqttConfig
from agent.delivery.outbox import Outbox, OutMessage
from agent.delivery.packet_limit import PacketLimit
from agent.mqtt.epoch import EpochStore
from agent.mqtt.inbound import Inbound
from agent.mqtt.messages import Incoming
from agent.mqtt.paho_fast import FastClient, new_client
from agent.mqtt.paho_plain import Client
from agent.mqtt.reconnect import CONNECT_TIMEOUT_S, backoff_delays, next_attempt, prepare
from agent.mqtt.session import (
    BrokerSession,
    Subscriptions,
    closed_early_text,
    no_connack_text,
    refusal_text,
)
from agent.mqtt.socket_wait import SocketWait
from agent.mqtt.window import Window
from agent.threads import NamedThread

log = logging.getLogger(__name__)

MISC_S = 0.5  # keepalive, acknowledgement timeout and CONNACK deadline checks
DRIVEN_S = 0.003  # the io thread does not read this long after a worker's kick (`_drive`)


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
        on_publish_refused: Callable[[str, str, bool], None] | None = None,
        on_session_lost: Callable[[], None] = lambda: None,
        packet_limit: PacketLimit | None = None,
        on_tick: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_publish_refused(topic, reason, first)`: a message was quarantined, never to be
        published again (`agent.mqtt.poison`); `first`: the first on its topic for a while.
        `on_session_lost()`: the broker kept no session where one was expected (`.session`).
        `on_tick()`: every `MISC_S` while connected (it must not raise). All called under the
        io lock: they may queue (never wait for) a message."""
        self._config = config
        self._outbox = outbox
        self._subscriptions = Subscriptions(subscriptions, config.protocol == "5")
        self.subscribed = self._subscriptions.active  # set once the broker has them
        self._will = will
        self._on_connected_hook = on_connected
        self._on_new_session = on_new_session
        self._on_tick = on_tick
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
        qos2_limit = 65535 if self.mqtt5 else config.max_inflight_qos2  # 5: Receive Maximum
        limit = packet_limit or PacketLimit(config.max_packet_bytes, mqtt5=self.mqtt5)
        self._window = Window(config.max_inflight, outbox, qos2_limit, packet_limit=limit)
        self._session = BrokerSession(config, on_session_lost)
        self._pending = self._window.pending  # the same dict: read on every queued message
        if on_publish_refused is not None:
            self._window.quarantine.on_refused = on_publish_refused
        self._leaving = False  # the agent itself ends the connection (not a loss to judge)
        self._inbound = Inbound(on_message, self.mqtt5)
        self.reconnects = 0
        self.lost_at: float | None = None  # wall time the last connection was lost
        self.last_error: str | None = None
        self._driven_until = 0.0  # a worker reads the socket until then (monotonic): `_drive`
        self._waiter = SocketWait()
        # Held by whoever drives paho: the io thread except while it waits in select, or a
        # thread that just queued a message and publishes it itself (`_on_queued`).
        self._io_lock = threading.Lock()
        outbox.set_on_queued(self._on_queued, self.wake, self._drive)
        self._client = self._inbound.client = self._make_client(client_id)
        self._thread = NamedThread(target=self._run, name="mqtt-io", daemon=True)

    # -- setup ---------------------------------------------------------------------------

    def _make_client(self, client_id: str) -> Client:
        client = new_client(
            client_id,
            MQTTProtocolVersion.MQTTv5 if self.mqtt5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if self.mqtt5 else False,
            manual_ack=True,  # a request is acknowledged only after it is stored (`defer`)
        )
        prepare(client, self._config)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_subscribe = self._subscriptions.acknowledged
        client.on_message = self._inbound.handle_message
        client.deliver = self._inbound.deliver
        client.acknowledged = self._window.acknowledged
        client.on_pre_connect = self._handle_pre_connect
        return client

    def add_ack_listener(self, listener: Callable[[float], None]) -> None:
        """Called with the acknowledgement latency (seconds) of every QoS 1/2 publish."""
        self._window.add_ack_listener(listener)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Interrupt the io thread's wait (any thread; cheap, never blocks)."""
        self._waiter.wake()

    def defer(self, incoming: Incoming) -> Callable[[], None]:
        """Take over the acknowledgement of `incoming` (QoS 1/2): see `Inbound.defer`."""
        return self._inbound.defer(incoming)

    def _on_queued(self, read: bool = False) -> None:
        """A message (or an acknowledgement) was queued on this thread: publish it from here
        when nobody drives the connection (the io thread waits in select), so a chunk goes to
        the socket without a hand-off. When the lock is taken, its holder publishes it: every
        holder looks at the outbox again after releasing the lock. `read`: see `_drive`."""
        while self._io_lock.acquire(blocking=False):
            try:
                client = self._client
                if self._stop.is_set() or client.socket() is None:
                    return
                if read and self._pending and client.loop_read() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    return  # the connection was lost: the io thread was woken for it
                self._pump(client)
                if read and self._pending:  # its acknowledgements are this thread's to read
                    self._driven_until = time.monotonic() + DRIVEN_S
                blocked = client.want_write()
            finally:
                self._io_lock.release()
            if blocked:
                self.wake()  # the socket is full: the io thread waits until it drains
                return
            if not self._work_waiting():
                return

    def _drive(self) -> None:
        """A worker's kick while it streams (`ReplySender.drive`, at most every 2 ms): as
        `_on_queued`, but while QoS 1/2 messages are in flight, what the broker sent
        (acknowledgements, requests) is first read and handled on this thread, and after it
        published them the io thread leaves the socket to it for `DRIVEN_S`: no wake-up and
        two hand-offs of the interpreter lock every few acknowledgements (decision 0034)."""
        self._on_queued(read=True)

    def _work_waiting(self) -> bool:
        """Something this connection could send now."""
        if self._inbound.deferred:
            return True
        if not self.connected.is_set() or self._window.full():
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
            attempt = next_attempt(attempt, time.monotonic() - started)
            delay = self._delay(attempt)
            log.info("mqtt: reconnecting in %.1f s (attempt %d)", delay, attempt)
            self._stop.wait(delay)

    def _connect_once(self) -> bool:
        config = self._config
        self._disconnected.clear()
        self._leaving = False
        if self._used and not self._fresh_client():
            return False
        self._used = True
        self._inbound.connection += 1
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
        except ConnectionError as e:  # a secret or TLS file that cannot be used (yet)
            self._note_error(str(e))
            return False
        except Exception as e:  # never the io thread: the next attempt may find it mended
            self._note_error(f"cannot set up a client: {type(e).__name__}: {e}")
            return False
        self._window.new_connection()
        self._client = self._inbound.client = client
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
        self._waiter.watch(sock)
        connect_deadline = time.monotonic() + CONNECT_TIMEOUT_S
        next_misc = time.monotonic() + MISC_S
        pending_tls = getattr(sock, "pending", None)
        self._io_lock.acquire()
        try:
            while not self._stop.is_set() and not self._disconnected.is_set():
                busy = self._pump(client)
                if client.socket() is None:
                    break  # lost while writing: paho called on_disconnect
                now = time.monotonic()
                if now >= next_misc:
                    next_misc = now + MISC_S
                    if not self._misc(client, now, connect_deadline):
                        break
                # A worker reading the socket (`_drive`) is left to it, unless the window is full
                reading = now >= self._driven_until or self._window.full()
                wait = (next_misc if reading else min(next_misc, self._driven_until)) - now
                tls_buffered = pending_tls is not None and pending_tls() > 0
                writing = client.want_write()  # the socket took only part of the last write
                self._io_lock.release()
                try:
                    # Looked at after the release: a message queued before it is seen here,
                    # one queued after it is published by the thread that queued it.
                    idle = not (busy or tls_buffered or self._work_waiting())
                    readable, writable = self._waiter.wait(
                        wait if idle else 0.0, read=reading, write=writing
                    )
                finally:
                    self._io_lock.acquire()
                if writable and client.loop_write():
                    return  # connection lost: paho called on_disconnect
                if (readable or tls_buffered) and client.loop_read():
                    return
        finally:
            self._io_lock.release()
            self._waiter.unwatch()

    def _pump(self, client: Client) -> bool:
        """Under the io lock: deferred acknowledgements, then the outbox up to the window,
        written with one loop_write. True when more messages may be waiting."""
        self._inbound.send_deferred(client)
        busy = self.connected.is_set() and self._window.publish_batch(client)
        if client.want_write():
            client.loop_write()  # a lost connection shows as on_disconnect
        return busy

    def _misc(self, client: mqtt.Client, now: float, connect_deadline: float) -> bool:
        """Keepalive (paho's loop_misc), the CONNACK deadline, acknowledgement timeouts."""
        if not self.connected.is_set() and now > connect_deadline:
            self._note_error(no_connack_text(CONNECT_TIMEOUT_S, self.mqtt5))
            return False
        if client.loop_misc() != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return False
        timeout = self._config.ack_timeout_s
        oldest = self._window.oldest_sent() if timeout > 0 and self.connected.is_set() else None
        if oldest is not None and now - oldest > timeout:
            self._note_error(f"no acknowledgement for {timeout:.0f} s: reconnecting")
            return False
        if self.connected.is_set():
            self._on_tick()
        return True

    def _drop_connection(self) -> None:
        """End the current connection, cleanly if it is still up (DISCONNECT, then close)."""
        client = self._client
        if client.socket() is None:
            self.connected.clear()
            return
        self._leaving = True  # a timeout or a stop: not the broker's doing
        with contextlib.suppress(Exception):
            client.disconnect()
            client.loop_write()
        with contextlib.suppress(Exception):
            sock = client.socket()
            if sock is not None:
                sock.close()
        self.connected.clear()

    def _note_error(self, message: str) -> None:  # logged once while it stays the same
        if message != self.last_error:
            log.warning("mqtt: %s", message)
        self.last_error = message

    # -- paho callbacks (under the io lock) ------------------------------------------------

    def _handle_pre_connect(self, client: mqtt.Client, userdata: Any) -> None:
        message = self._will(self._epoch.next())
        client.will_set(message.topic, message.payload, message.qos, message.retain)

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
            self._note_error(refusal_text(reason, self.mqtt5))
            self._disconnected.set()
            return
        epoch = self._epoch.next()
        self._epoch.commit(epoch)
        self._window.apply_broker_limits(properties)
        self._session.connected(self._client, bool(flags.session_present), self._window.unreleased)
        self._window.unreleased = set()
        again = self.reconnects or self.connected.is_set()
        what = "reconnected" if again else f"connected to {self._config.host}:{self._config.port}"
        log.info("mqtt: %s (epoch %d)", what, epoch)
        self.last_error = None
        self._subscriptions.subscribe(client)
        try:
            self._on_connected_hook(epoch)
        except Exception:
            log.exception("mqtt: on_connected hook failed")
        self.connected.set()

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
        self._subscriptions.lost()
        if was_connected:
            self.reconnects += 1
            self.lost_at = time.time()
            if not self._stop.is_set():
                self._note_error(f"connection lost: {reason}")
                if not self._leaving:
                    # what was in flight may hold a poison
                    self._window.connection_lost(int(reason.value), str(reason))
        elif not self._stop.is_set() and self.last_error is None:
            self._note_error(closed_early_text(reason, self.mqtt5))
        self._disconnected.set()
        self.wake()  # noticed on another thread: the io thread may be waiting in select

    # -- health and stop -------------------------------------------------------------------

    def thread_problem(self) -> str | None:
        """Whether the connection's thread died (for the systemd watchdog; an outage is not)."""
        if self._thread.ident is not None and not self._thread.is_alive():
            return f"the {self._thread.name} thread died"
        return None

    @property
    def window_limit(self) -> int:
        """QoS 1/2 publishes allowed unacknowledged now (after the broker's Receive Maximum)."""
        return self._window.limit

    @property
    def sessions_lost(self) -> int:
        """Connections on which the broker had lost the session it was expected to keep."""
        return self._session.lost

    @property
    def acked(self) -> int:
        """QoS 1/2 publishes the broker acknowledged."""
        return self._window.acked

    @property
    def publish_failures(self) -> int:
        """Publishes refused by paho or by the broker (a failure reason code)."""
        return self._window.publish_failures

    @property
    def quarantined(self) -> int:
        """Messages never published again (`agent.mqtt.poison`)."""
        return self._window.quarantine.count

    @property
    def fast_path(self) -> bool:
        """Whether the client is the fast one (else paho's own: see `agent.mqtt.paho_fast`)."""
        return isinstance(self._client, FastClient)

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
        self._waiter.close()
