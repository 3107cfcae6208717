"""The `/metrics` + `/healthz` server against peers that connect and send nothing, or trickle:
the health check still answers, and the server closes the idle connections itself."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from agent.ops.endpoint import MetricsServer
from agent.ops.metrics import AgentMetrics, Gauges
from tests.ops_helpers import scrape


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    metrics = AgentMetrics(Gauges, device="x", version="0")
    s = MetricsServer(
        metrics.registry,
        "127.0.0.1",
        0,
        lambda: (True, {"status": "ok"}),
        request_timeout=1.0,
        max_connections=8,
    )
    s.start()
    yield s
    s.close()


def silent_sockets(server: MetricsServer, n: int) -> list[socket.socket]:
    """`n` connections to the server that send nothing."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection((server.host, server.port), timeout=30)
        socks.append(sock)
    return socks


def closed_by_peer(sock: socket.socket) -> bool:
    """Wait (30 s at most) for the server to close `sock`: EOF or a reset."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_silent_connections_do_not_block_the_health_check():
    """Served one at a time, the health check would wait out every silent peer (60 s each)."""
    metrics = AgentMetrics(Gauges, device="x", version="0")
    s = MetricsServer(metrics.registry, "127.0.0.1", 0, lambda: (True, {}), request_timeout=60)
    s.start()
    socks = silent_sockets(s, 5)
    try:
        body = json.loads(scrape(s.url + "/healthz", timeout=30))
        assert body["ok"] is True
        assert "edge_agent_info" in scrape(s.url + "/metrics", timeout=30)
    finally:
        s.close()  # cuts the silent ones (no_leaked_threads checks their threads ended)
        for sock in socks:
            sock.close()


def test_silent_connections_are_closed_after_the_timeout(server: MetricsServer):
    socks = silent_sockets(server, 5)
    try:
        assert json.loads(scrape(server.url + "/healthz", timeout=30))["ok"] is True
        assert all(closed_by_peer(s) for s in socks), "an idle connection was kept open"
    finally:
        for s in socks:
            s.close()


def test_a_trickling_peer_is_cut_at_the_connection_deadline(server: MetricsServer):
    """One byte now and then resets no deadline: the whole exchange has one."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    stop = threading.Event()
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")

        def trickle() -> None:
            while not stop.wait(0.3):
                try:
                    sock.sendall(b"X")
                except OSError:
                    return

        t = threading.Thread(target=trickle, name="test-trickle")
        t.start()
        try:
            data = b""
            while True:
                try:
                    chunk = sock.recv(4096)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
            assert b"200 OK" not in data  # cut, never answered
        finally:
            stop.set()
            t.join()
    finally:
        sock.close()


def healthy_within(server: MetricsServer, seconds: float) -> bool:
    """Ask `/healthz` until it answers (a refused connection is retried)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return bool(json.loads(scrape(server.url + "/healthz", timeout=seconds))["ok"])
        except (OSError, http.client.HTTPException):
            time.sleep(0.1)
    return False


def test_connections_beyond_the_bound_are_closed_at_once(server: MetricsServer):
    socks = silent_sockets(server, 8)  # the bound of the fixture's server
    try:
        extra = socket.create_connection((server.host, server.port), timeout=30)
        try:
            # closed on arrival, long before the 1 s request timeout could have done it
            assert closed_by_peer(extra)
        finally:
            extra.close()
        for s in socks:
            s.close()
        # the slots free up as the server notices the closed connections
        assert healthy_within(server, 30)
    finally:
        for s in socks:
            s.close()


def test_close_ends_connection_threads_still_waiting():
    metrics = AgentMetrics(Gauges, device="x", version="0")
    s = MetricsServer(metrics.registry, "127.0.0.1", 0, lambda: (True, {}))  # 5 s timeout
    s.start()
    socks = silent_sockets(s, 3)
    try:
        scrape(s.url + "/healthz", timeout=30)  # served: the silent ones have their threads
    finally:
        s.close()  # the no_leaked_threads fixture checks that every metrics-http thread ended
        for sock in socks:
            sock.close()
