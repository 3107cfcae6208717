"""sd_notify against a real datagram socket, the watchdog, credentials, the unit file."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agent.config import load_config
from agent.demo.broker import EmbeddedBroker
from agent.inference import modes
from agent.ops.systemd import (
    Notifier,
    ServiceReporter,
    credential_path,
    socket_address,
    watchdog_usec,
)
from agent.service.agent import Agent
from tests.conftest import agent_config
from tests.ops_helpers import NotifyListener, base_config, start_agent, wait_until, write_config

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "edge-agent.service"


@pytest.fixture
def listener():
    listeners: list[NotifyListener] = []

    def make(abstract: bool = False) -> NotifyListener:
        listeners.append(NotifyListener(abstract=abstract))
        return listeners[-1]

    yield make
    for item in listeners:
        item.close()


# -- the protocol ---------------------------------------------------------------------------------


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_notifier_speaks_the_protocol(listener, abstract):
    sink = listener(abstract)
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": sink.address})
    assert notifier.enabled
    assert notifier.ready("serving 3 models\nbroker up")
    assert notifier.watchdog()
    assert notifier.stopping("stopping")
    assert notifier.reloading()
    assert notifier.extend_timeout(1.5)
    sink.wait_for("EXTEND_TIMEOUT_USEC")
    raw = [m.raw for m in sink.messages]
    # One datagram per call; STATUS stays one line even when the text had a newline.
    assert raw[0] == "READY=1\nSTATUS=serving 3 models broker up"
    assert raw[1] == "WATCHDOG=1"
    assert raw[2] == "STOPPING=1\nSTATUS=stopping"
    reloading = sink.messages[3].fields
    assert reloading["RELOADING"] == "1"
    assert abs(int(reloading["MONOTONIC_USEC"]) - time.monotonic_ns() // 1000) < 5_000_000
    assert raw[4] == "EXTEND_TIMEOUT_USEC=1500000"
    notifier.close()


def test_notifier_is_a_noop_without_notify_socket(caplog):
    env = {"WATCHDOG_USEC": "1000000"}
    notifier = Notifier.from_environ(env)
    assert not notifier.enabled
    assert not notifier.ready() and not notifier.watchdog()
    assert socket_address("relative/path") is None
    assert socket_address("@abc") == b"\0abc" and socket_address("/run/x") == "/run/x"


def test_from_environ_unset_hides_the_variables_from_children(listener):
    sink = listener()
    env = {"NOTIFY_SOCKET": sink.address, "WATCHDOG_USEC": "2000000", "OTHER": "1"}
    notifier = Notifier.from_environ(env, unset=True)
    assert env == {"OTHER": "1"}
    assert notifier.enabled and notifier.watchdog_s == 2.0


def test_watchdog_usec_is_only_for_the_named_pid():
    assert watchdog_usec({"WATCHDOG_USEC": "30000000"}) == 30_000_000
    assert (
        watchdog_usec({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30_000_000
    )
    assert watchdog_usec({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_usec({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_usec({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_usec({}) is None


def test_a_vanished_socket_is_logged_once_and_never_raises(tmp_path, caplog):
    notifier = Notifier(str(tmp_path / "gone"))
    with caplog.at_level(logging.WARNING, logger="agent.ops.systemd"):
        assert not notifier.ready()
        assert not notifier.watchdog()
    assert len([r for r in caplog.records if "notify socket" in r.getMessage()]) == 1
    notifier.close()


def test_reporter_pings_only_while_healthy(listener):
    sink = listener()
    reporter = ServiceReporter(Notifier(sink.address, watchdog_usec=30_000))  # ping every 10 ms
    reporter.tick(ready=False, problem=None, status="waiting for broker")
    reporter.tick(ready=True, problem=None, status="serving")
    for _ in range(5):
        time.sleep(0.012)
        reporter.tick(ready=True, problem=None, status="serving")
    stuck_from = time.monotonic()
    for _ in range(5):
        time.sleep(0.012)
        reporter.tick(ready=True, problem="worker stuck", status="serving")
    sink.wait_for("STATUS", "unhealthy: worker stuck")
    time.sleep(0.05)
    assert not [m for m in sink.with_key("WATCHDOG", since=stuck_from + 0.005)]
    assert [m.raw for m in sink.messages][:2] == [
        "EXTEND_TIMEOUT_USEC=60000000",
        "STATUS=waiting for broker",
    ]
    assert sum("READY" in m.fields for m in sink.messages) == 1
    assert len(sink.with_key("WATCHDOG")) >= 3


# -- the agent ---------------------------------------------------------------------------------


def _agent(tmp_path, broker, repository, notifier, **env) -> Agent:
    config = agent_config(tmp_path, broker, repository, METRICS__ENABLED="false", **env)
    return Agent(config, notifier=notifier)


def test_ready_only_once_the_broker_is_connected_and_models_are_warm(
    tmp_path, repository, listener
):
    sink = listener(abstract=True)
    broker = EmbeddedBroker()  # not started yet: the agent must wait for it
    agent = _agent(
        tmp_path,
        broker,
        repository,
        Notifier(socket_address(sink.address), watchdog_usec=2_000_000),
        MQTT__RECONNECT_MIN_S="0.05",
        MQTT__RECONNECT_MAX_S="0.2",
    )
    try:
        agent.start()
        assert agent.models.ready()  # loaded and warmed up before start() returned
        sink.wait_for("STATUS", timeout=5)
        time.sleep(0.6)
        assert not sink.with_key("READY"), "READY before the broker was there"
        assert not sink.with_key("WATCHDOG")
        assert any("waiting for broker" in m.fields["STATUS"] for m in sink.with_key("STATUS"))
        assert sink.with_key("EXTEND_TIMEOUT_USEC")  # the start timeout is pushed out meanwhile
        broker.start()
        ready = sink.wait_for("READY", "1", timeout=10)
        assert agent.transport.connected.is_set()
        assert "serving 3 of 3 model(s)" in ready.fields["STATUS"]
        assert "connected" in ready.fields["STATUS"]
        sink.wait_for("WATCHDOG", "1", timeout=5, after=ready.at + 0.1)
    finally:
        agent.stop()
        broker.close()
    stopping = sink.wait_for("STOPPING", "1")
    assert stopping.at > ready.at


release = threading.Event()  # while clear, a decode hangs before its first step: a stuck worker


def _hanging_steps(run):
    release.wait(30)
    yield from modes.steps(run)


def test_watchdog_pings_stop_while_a_worker_is_stuck(
    tmp_path, broker, repository, listener, make_client, monkeypatch
):
    monkeypatch.setitem(modes.STRATEGIES, "steps", _hanging_steps)
    release.clear()
    sink = listener()
    agent = _agent(
        tmp_path,
        broker,
        repository,
        Notifier(sink.address, watchdog_usec=300_000),  # a ping every 0.1 s while healthy
        SCHEDULER__WORKERS="1",
        SYSTEMD__STUCK_AFTER_S="1.0",
    )
    agent.start()
    try:
        ready = sink.wait_for("READY", "1")
        time.sleep(0.5)
        assert len(sink.with_key("WATCHDOG", since=ready.at)) >= 3
        client = make_client(broker, agent)
        token = np.array([[1]], dtype=np.int64)
        reply = client.request("decoder", {"token": token}, params={"max_steps": 2})
        assert wait_until(lambda: agent.scheduler.busy == 1, 5)

        def unhealthy_lines():
            return [
                m for m in sink.with_key("STATUS", ready.at) if "unhealthy" in m.fields["STATUS"]
            ]

        assert wait_until(lambda: bool(unhealthy_lines()), 5)
        unhealthy = unhealthy_lines()[0]
        assert "inference worker has run one job" in unhealthy.fields["STATUS"]
        assert agent.health_problem() is not None
        time.sleep(1.0)
        # No ping since the worker counted as stuck: systemd would restart the service.
        assert not sink.with_key("WATCHDOG", since=unhealthy.at + 0.05)
        released = time.monotonic()
        release.set()
        assert reply.collect()["next_token"].shape[0] == 2  # the request still completes
        sink.wait_for("WATCHDOG", "1", timeout=5, after=released)
        assert agent.health_problem() is None
    finally:
        release.set()
        agent.stop()


def test_stopping_on_sigterm_from_a_real_process(tmp_path, broker, repository, listener):
    sink = listener(abstract=True)
    config = write_config(
        tmp_path / "agent.toml", base_config(tmp_path, broker.host, broker.port, repository)
    )
    process = start_agent(config, env={"NOTIFY_SOCKET": sink.address, "WATCHDOG_USEC": "1000000"})
    try:
        ready = sink.wait_for("READY", "1", timeout=20)
        sink.wait_for("WATCHDOG", "1", timeout=5, after=ready.at)
        process.send_signal(signal.SIGTERM)
        stopping = sink.wait_for("STOPPING", "1", timeout=10)
        assert "draining" in stopping.fields.get("STATUS", "")
        _, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err[-2000:]
    assert "stopped" in err


# -- credentials --------------------------------------------------------------------------------


def test_relative_secret_paths_resolve_to_the_credentials_directory(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "mqtt-password").write_text("from-systemd\n")
    (creds / "client.key").write_text("KEY")
    conf_dir = tmp_path / "etc"
    conf_dir.mkdir()
    path = conf_dir / "agent.toml"
    path.write_text(
        '[mqtt]\nusername = "agent"\npassword_file = "mqtt-password"\n'
        '[mqtt.tls]\nenabled = true\nkey_file = "client.key"\nca_file = "/etc/ssl/ca.pem"\n'
    )
    under_systemd = load_config(path, {"CREDENTIALS_DIRECTORY": str(creds)})
    assert under_systemd.mqtt.password_file == creds / "mqtt-password"
    assert under_systemd.mqtt.tls.key_file == creds / "client.key"
    assert under_systemd.mqtt.tls.ca_file == Path("/etc/ssl/ca.pem")  # absolute: as written
    by_hand = load_config(path, {})
    assert by_hand.mqtt.password_file == conf_dir / "mqtt-password"
    # A credential the unit did not load falls back to the config folder, too.
    assert credential_path(Path("other"), {"CREDENTIALS_DIRECTORY": str(creds)}) is None


# -- the unit file ------------------------------------------------------------------------------


def _unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_file_has_what_operators_expect():
    s = _unit_settings()
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"]
    assert s["WatchdogSec"] and s["StateDirectory"]
    assert any("check-config" in v for v in s["ExecStartPre"])
    assert any(v.startswith("mqtt-password:") for v in s["LoadCredential"])
    assert any("HUP" in v for v in s["ExecReload"])
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert s[key] == ["yes"], key
    assert s["ProtectSystem"] == ["strict"]
    assert s["User"] == ["edge-agent"]
    assert any("/dev/nvmap" in v for v in s["DeviceAllow"])
    assert s.get("ReadWritePaths")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` on the real unit; only the binary path is pointed at a stub."""
    stub = tmp_path / "edge-agent"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    unit = tmp_path / "edge-agent.service"
    unit.write_text(UNIT.read_text().replace("/opt/edge-agent/bin/edge-agent", str(stub)))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and "edge-agent.service" in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


@pytest.mark.parametrize(
    "name", ["agent.toml", "dev-laptop.toml", "jetson-tls.toml", "container.toml"]
)
def test_example_configs_are_valid(name, tmp_path):
    """Every key in the examples exists (unknown keys are errors); files on the box may not."""
    creds = tmp_path / "creds"
    creds.mkdir()
    for credential in ("mqtt-password", "client.key"):
        (creds / credential).write_text("x")
    config = load_config(ROOT / "configs" / name, {"CREDENTIALS_DIRECTORY": str(creds)})
    assert config.metrics.host in ("127.0.0.1", "0.0.0.0")
    if name == "jetson-tls.toml":
        assert config.mqtt.tls.enabled and config.mqtt.tls.key_file == creds / "client.key"
        assert config.mqtt.password_file == creds / "mqtt-password"
