"""A minimal MQTT 3.1.1 client for the closed-loop load peer (`peers load`).

The load peer shares the benchmark machine with the agent and the broker, and what it spends
is taken from them. paho spends about 200 µs of CPU per request and reply on the 2-core VM
(its packet objects, a `recv` per header byte, a `send` and a wake-up of its own loop per
publish): a third of the machine, in both the batched and the unbatched run, which flattens
the ratio that the batching figure is about. On a box the requests come from other machines.
This client does what the closed loop needs and nothing else, in one thread: connect,
subscribe, publish at QoS 0/1, acknowledge what arrives, with every read taking whatever the
socket holds and every write sending all packets due at once. It is benchmark tooling, not a
general client: no QoS 2, no reconnects, no keepalive (0: the broker never expects a ping),
no TLS.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time

CONNECT, CONNACK, PUBLISH, PUBACK, SUBSCRIBE, SUBACK = 1, 2, 3, 4, 8, 9


def _length(n: int) -> bytes:
    """MQTT's variable-length remaining length."""
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _text(s: str) -> bytes:
    data = s.encode()
    return struct.pack("!H", len(data)) + data


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + _length(len(body)) + body


class LeanClient:
    """One blocking TCP connection (TCP_NODELAY, as every client of the benchmarks)."""

    def __init__(self, host: str, port: int, client_id: str, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._mid = 0
        # Protocol "MQTT" level 4, clean session, keepalive 0.
        body = _text("MQTT") + b"\x04\x02\x00\x00" + _text(client_id)
        self.sock.sendall(packet(CONNECT << 4, body))
        _, body = self._expect(CONNACK, timeout)
        if len(body) != 2 or body[1] != 0:
            raise ConnectionError(f"the broker refused the connection: {bytes(body)!r}")

    def next_mid(self) -> int:
        self._mid = self._mid % 65535 + 1
        return self._mid

    def subscribe(self, topic: str, qos: int, timeout: float = 10.0) -> None:
        mid = self.next_mid()
        body = struct.pack("!H", mid) + _text(topic) + bytes([qos])
        self.sock.sendall(packet(SUBSCRIBE << 4 | 0x02, body))
        _, reply = self._expect(SUBACK, timeout)
        if reply[2] == 0x80:
            raise ConnectionError(f"the broker refused the subscription to {topic}")

    def publish_packet(self, topic: str, payload: bytes, qos: int) -> bytes:
        """A PUBLISH to send (a fresh message id at QoS 1)."""
        header = _text(topic) + (struct.pack("!H", self.next_mid()) if qos else b"")
        return packet(PUBLISH << 4 | qos << 1, header + payload)

    def read(self, timeout: float) -> list[tuple[int, bytes]]:
        """The complete packets that arrived within `timeout`: (first byte, body)."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return []
        data = self.sock.recv(1 << 18)
        if not data:
            raise ConnectionError("the broker closed the connection")
        buf = self._buf
        buf += data
        packets, pos, size = [], 0, len(buf)
        while size - pos >= 2:
            n, shift, i = 0, 0, pos + 1
            while i < size:
                byte = buf[i]
                n |= (byte & 0x7F) << shift
                shift += 7
                i += 1
                if not byte & 0x80:
                    break
            else:
                break  # the length is not complete yet
            if size - i < n:
                break
            packets.append((buf[pos], bytes(buf[i : i + n])))
            pos = i + n
        del buf[:pos]
        return packets

    def _expect(self, kind: int, timeout: float) -> tuple[int, bytes]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for first, body in self.read(left):
                if first >> 4 == kind:
                    return first, body
        raise ConnectionError(f"no packet of type {kind} from the broker within {timeout} s")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(b"\xe0\x00")  # DISCONNECT
        self.sock.close()


def parse_publish(first: int, body: bytes) -> tuple[int | None, bytes]:
    """(message id or None at QoS 0, payload) of a PUBLISH body."""
    qos = (first >> 1) & 3
    pos = 2 + (body[0] << 8 | body[1])
    if not qos:
        return None, body[pos:]
    return body[pos] << 8 | body[pos + 1], body[pos + 2 :]


def puback(mid: int) -> bytes:
    return bytes([PUBACK << 4, 2, mid >> 8, mid & 0xFF])
