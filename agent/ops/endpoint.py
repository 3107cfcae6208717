"""The HTTP endpoint of a running agent: `/metrics` (a registry in the Prometheus text format,
see agent.ops.metrics) and `/healthz` (the service's health check as JSON, 200 or 503), served
on one thread from the standard library's WSGI server.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

Health = Callable[[], tuple[bool, dict[str, Any]]]


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (a scrape every 15 s would flood the journal), and a timeout."""

    timeout = 5.0

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _server_class(host: str) -> type[WSGIServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(WSGIServer):
        address_family = family
        allow_reuse_address = True

    return Server


class MetricsServer:
    """`/metrics` (Prometheus text format) and `/healthz` (200 or 503 with JSON) on one thread.

    A single-threaded server on purpose: scrapes are small and rare, and one named thread
    that `close()` joins is easier to account for than a thread per request.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int, health: Health) -> None:
        self._metrics_app = make_wsgi_app(registry)
        self._health = health
        self._server = make_server(
            host, port, self._app, server_class=_server_class(host), handler_class=_QuietHandler
        )
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="metrics-http",
            daemon=True,  # joined by close(); daemon only so a failed start cannot hang the exit
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
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
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout)
        self._server.server_close()
