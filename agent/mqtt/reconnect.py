"""What every connection attempt needs afresh: the delay before it (capped exponential
backoff with full jitter) and a client set up from `[mqtt]` (`prepare`: the password read
from its file each time, so a rotated secret is picked up by the next attempt, TLS,
TCP_NODELAY).

paho's built-in reconnect has no jitter: a fleet of boxes would reconnect in lock step after
a broker restart. `Transport` owns reconnects, with a new client for every attempt.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from agent.config import MqttConfig

CONNECT_TIMEOUT_S = 10.0  # TCP connect, TLS handshake and CONNACK


def backoff_delays(min_s: float, max_s: float, rng: random.Random) -> Callable[[int], float]:
    """Full jitter: attempt n waits uniformly in [min_s, min(max_s, min_s * 2**n)]."""

    def delay(attempt: int) -> float:
        ceiling = min(max_s, min_s * (2 ** min(attempt, 30)))
        return rng.uniform(min_s, max(min_s, ceiling))

    return delay


def next_attempt(attempt: int, lasted_s: float, reset_after_s: float = 60.0) -> int:
    """The attempt number after a connection (or attempt) that lasted `lasted_s`: back to 0
    only when it lasted `reset_after_s`. A broker that accepts the connection and drops it at
    once (a refused publish, a session it cannot take) keeps the backoff growing, as a
    refused connection does."""
    return 0 if lasted_s > reset_after_s else attempt + 1


def read_secret(path: Path) -> str:
    """A password from a file (or systemd's credentials folder); the value is never logged.
    ConnectionError where it cannot be read as text."""
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as e:
        raise ConnectionError(f"cannot read password file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConnectionError(f"password file {path} is not UTF-8 text") from None


def credentials(config: MqttConfig) -> tuple[str | None, str | None]:
    """The username and the password read from its file (read only with a username: it is
    sent with one); ConnectionError where the file cannot be read."""
    if config.username is None:
        return None, None
    password = read_secret(config.password_file) if config.password_file else None
    return config.username, password


def tls_context(config: MqttConfig) -> ssl.SSLContext | None:
    """The TLS context of `[mqtt.tls]`; None when TLS is off. ConnectionError naming the
    setting whose file cannot be used (missing, unreadable, not PEM, a key that does not
    match its certificate, or one encrypted with a passphrase: no prompt on a service)."""
    tls = config.tls
    if not tls.enabled:
        return None
    try:
        context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    except (OSError, ssl.SSLError, ValueError) as e:
        raise ConnectionError(f"mqtt.tls.ca_file {tls.ca_file}: {_reason(e)}") from None
    if tls.cert_file:
        key = str(tls.key_file) if tls.key_file else None
        try:
            context.load_cert_chain(str(tls.cert_file), key, password=_no_passphrase)
        except (OSError, ssl.SSLError, ValueError, _Encrypted) as e:
            raise ConnectionError(
                f"mqtt.tls.cert_file {tls.cert_file} / key_file {tls.key_file}: {_reason(e)}"
            ) from None
    context.check_hostname = tls.check_hostname
    return context


class _Encrypted(Exception):
    """The key asks for a passphrase."""


def _no_passphrase() -> str:
    raise _Encrypted("the key is encrypted with a passphrase; use an unencrypted key file")


def _reason(error: Exception) -> str:
    """What an OpenSSL or file error says, in a line."""
    if isinstance(error, ssl.SSLError):
        return f"{error.reason} ({error.library or 'SSL'})" if error.reason else "not PEM"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def prepare(client: mqtt.Client, config: MqttConfig) -> None:
    """A new client set up from `config` before it connects: the in-flight cap, the connect
    timeout, the credentials, TLS, TCP_NODELAY on its socket, and publishes left queued for
    the transport's io loop to write. ConnectionError when the password cannot be read."""
    client.max_inflight_messages_set(config.max_inflight)
    client.connect_timeout = CONNECT_TIMEOUT_S
    if config.tcp_nodelay:
        client.on_socket_open = _no_delay
    # Publishes are only queued; the io lock's holder writes a batch with one loop_write.
    client.on_socket_register_write = _ignore_socket
    username, password = credentials(config)
    if username is not None:
        client.username_pw_set(username, password)
    context = tls_context(config)
    if context is not None:
        client.tls_set_context(context)


def _no_delay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """paho's on_socket_open: small packets leave at once (Nagle would hold them for the
    peer's delayed ACK: 40 ms a chunk)."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _ignore_socket(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    """paho's on_socket_register_write: publishes stay queued until the io loop writes them."""
