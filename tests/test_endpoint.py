"""The `/metrics` + `/healthz` server on its own (agent.ops.endpoint); with a running agent
in tests/test_metrics.py."""

from __future__ import annotations

import urllib.error

import pytest

from agent.ops.endpoint import MetricsServer
from agent.ops.metrics import AgentMetrics, Gauges
from tests.ops_helpers import scrape


def test_metrics_server_reports_a_failing_health_check_as_503():
    metrics = AgentMetrics(Gauges, device="x", version="0")

    def broken():
        raise RuntimeError("boom")

    server = MetricsServer(metrics.registry, "127.0.0.1", 0, broken)
    server.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(server.url + "/healthz")
        assert e.value.code == 503
        assert "edge_agent_info" in scrape(server.url + "/metrics")
    finally:
        server.close()
