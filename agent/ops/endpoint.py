"""The HTTP endpoint of a running agent: `/metrics` (a registry in the Prometheus text format,
see agent.ops.metrics) and `/healthz` (the service's health check as JSON, 200 or 503), served
from the standard library's WSGI server, one short-lived thread per connection.

A peer on the network must not be able to take the endpoint (and with it the container's
HEALTHCHECK, `edge-agent health`) away: every connection has its own thread, every socket
operation a timeout, every connection a deadline for its whole exchange, and connections
beyond a bound are closed at once instead of queueing behind the slow ones.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from agent.threads import NamedThread

Health = Callable[[], tuple[bool, dict[str, Any]]]

REQUEST_TIMEOUT_S = 5.0  # one socket operation (a read, a write) of a request
MAX_CONNECTIONS = 16  # connections served at once; more are closed on arrival
THREAD_NAME = "metrics-http"  # the serving thread; connection threads add "-conn-N"


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (a scrape every 15 s would flood the journal); the socket
    timeout comes from the server (`request_timeout`)."""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(getattr(self.server, "request_timeout", REQUEST_TIMEOUT_S))

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(WSGIServer):
    """A WSGI server with a named thread per connection, a bound and a deadline on them.

    Connections are accepted by the serving thread; each is handled on its own thread
    (`metrics-http-conn-N`). Beyond `max_connections` a connection is closed on arrival.
    The serving thread cuts (shuts down) any connection older than its deadline, so a peer
    trickling one byte every few seconds cannot hold a thread for longer than that.
    """

    allow_reuse_address = True
    daemon_threads = True
    request_timeout = REQUEST_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        super().__init__(address, _QuietHandler)
        self._lock = threading.Lock()
        self._active: dict[socket.socket, tuple[float, threading.Thread]] = {}
        self._names = itertools.count(1)

    @property
    def deadline_s(self) -> float:
        """The longest a connection is served: two socket timeouts (read, then write)."""
        return 2 * self.request_timeout

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve `request` on a thread of its own, or close it when the bound is reached."""
        with self._lock:
            if len(self._active) >= self.max_connections:
                refused = True
            else:
                refused = False
                thread = NamedThread(
                    target=self._serve_one,
                    args=(request, client_address),
                    name=f"{THREAD_NAME}-conn-{next(self._names)}",
                    daemon=True,  # joined by close_connections()
                )
                self._active[request] = (time.monotonic(), thread)
        if refused:
            self.shutdown_request(request)
            return
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: this connection goes, the server stays
            with self._lock:
                self._active.pop(request, None)
            self.shutdown_request(request)

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            pass  # a peer that went away or timed out: nothing to report
        finally:
            with self._lock:  # unregistered before it is closed: _cut never sees a closed one
                self._active.pop(request, None)
            self.shutdown_request(request)

    def service_actions(self) -> None:
        """Between accepts (every poll interval): cut connections past their deadline."""
        self._cut(time.monotonic() - self.deadline_s)

    def _cut(self, started_before: float) -> list[threading.Thread]:
        """Shut down the connections started before `started_before`; their threads."""
        with self._lock:
            late = [(s, t) for s, (at, t) in self._active.items() if at <= started_before]
            for sock, _thread in late:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's blocked read or write
        return [thread for _sock, thread in late]

    def close_connections(self, timeout: float) -> None:
        """Cut every connection still served and join its thread."""
        deadline = time.monotonic() + timeout
        for thread in self._cut(float("inf")):
            thread.join(max(0.0, deadline - time.monotonic()))


class MetricsServer:
    """`/metrics` (Prometheus text format) and `/healthz` (200 or 503 with JSON).

    One named serving thread accepts; each connection is handled on a thread of its own,
    at most `max_connections` at once, each socket operation bounded by `request_timeout`.
    The handlers themselves run one at a time (the collectors were written for one reader);
    only the network exchange is concurrent. `close()` joins every thread.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        health: Health,
        *,
        request_timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._metrics_app = make_wsgi_app(registry)
        self._health = health
        self._app_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = _Server((host, port), family)
        self._server.request_timeout = request_timeout
        self._server.max_connections = max_connections
        self._server.set_app(self._app)
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = NamedThread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=THREAD_NAME,
            daemon=True,  # joined by close(); daemon only so a failed start cannot hang the exit
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with self._app_lock:
            return self._route(environ, start_response)

    def _route(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            result: Iterable[bytes] = self._metrics_app(environ, start_response)
            return result
        if path == "/healthz":
            try:
                ok, details = self._health()
            except Exception as e:  # report, never raise into the server loop
                ok, details = False, {"problem": f"health check failed: {type(e).__name__}"}
            body = json.dumps({"ok": ok, **details}).encode()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json")])
            return [body]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"edge-agent: /metrics /healthz\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, cut the connections still open, join every thread."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.close_connections(timeout)
        self._server.server_close()
