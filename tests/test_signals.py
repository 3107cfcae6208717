"""Signals on a real `edge-agent run` process: SIGTERM under load, SIGHUP reloads; secrets."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.client import AgentClient
from agent.config import load_config
from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload, encode_payload
from tests.ops_helpers import (
    LineReader,
    NotifyListener,
    base_config,
    run_cli,
    sample,
    scrape,
    start_agent,
    wait_until,
    write_config,
)


class Recorder:
    """A plain paho subscriber at QoS 2: sees each message with the QoS it was published at."""

    def __init__(self, broker, pattern: str) -> None:
        self.messages: list[tuple[str, int, bytes]] = []
        self._lock = threading.Lock()
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"rec-{uuid.uuid4().hex[:8]}"
        )
        subscribed = threading.Event()
        self._client.on_message = self._on_message
        self._client.on_subscribe = lambda *a: subscribed.set()
        self._client.on_connect = lambda c, *a: c.subscribe(pattern, 2)
        self._client.connect(broker.host, broker.port)
        self._client.loop_start()
        assert subscribed.wait(10)

    def _on_message(self, client, userdata, message) -> None:
        with self._lock:
            self.messages.append((message.topic, message.qos, bytes(message.payload)))

    def decoded(self, topic_part: str = "") -> list[tuple[str, int, dict]]:
        with self._lock:
            items = list(self.messages)
        out = []
        for topic, qos, payload in items:
            if topic_part in topic:
                try:
                    out.append((topic, qos, decode_payload(payload, Limits())))
                except WireError:
                    continue
        return out

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


@pytest.fixture
def recorders():
    made: list[Recorder] = []

    def make(broker, pattern: str) -> Recorder:
        made.append(Recorder(broker, pattern))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def processes():
    """Agent processes, killed if a test leaves one behind."""
    running = []

    def make(*args, **kw):
        process = start_agent(*args, **kw)
        running.append(process)
        return process, LineReader(process.stderr)

    yield make
    for process in running:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        if process.stdout:
            process.stdout.close()


def _metrics_url(config: Path) -> str:
    port = load_config(config).metrics.port
    return f"http://127.0.0.1:{port}/metrics"


def _wait_online(recorder: Recorder, timeout: float = 20) -> None:
    """The agent subscribed before it published `online` (one connection keeps the order)."""
    assert wait_until(
        lambda: any(m.get("state") == "online" for *_, m in recorder.decoded("/status")), timeout
    ), "the agent never came online"


def _client(broker, config: Path) -> AgentClient:
    device = load_config(config).device_id
    return AgentClient(broker.host, broker.port, device_id=device).connect()


# -- SIGTERM ------------------------------------------------------------------------------------


def test_sigterm_under_load_answers_every_request_and_exits_0(
    tmp_path, broker, repository, processes, recorders
):
    extra = "[scheduler]\nworkers = 1\ndrain_timeout_s = 1.0\n"
    config = write_config(
        tmp_path / "agent.toml", base_config(tmp_path, broker.host, broker.port, repository, extra)
    )
    process, stderr = processes(config)
    client = _client(broker, config)
    try:
        root = client.root
        replies = recorders(broker, f"{root}/result/mlp/+")
        status = recorders(broker, f"{root}/status")
        _wait_online(status)
        # 40 x 1024 chunks: more than one worker answers in the 1 s drain, however fast it is
        x = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32)
        ids = [f"load-{i}" for i in range(40)]
        for request_id in ids:
            body = {"id": request_id, "inputs": {"x": x}}
            client.publish_raw(f"{root}/infer/mlp", encode_payload(body), qos=1)

        def all_received() -> bool:
            text = _scrape_or_none(_metrics_url(config)) or ""
            return sample(text, "edge_agent_requests_received_total") == len(ids)

        assert wait_until(all_received, 20), "the agent did not take every request"
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    finally:
        client.close()
    stderr.join()
    assert process.returncode == 0, stderr.text()[-3000:]
    terminal: dict[str, list[dict]] = {}
    assert wait_until(
        lambda: len({m["id"] for _, _, m in replies.decoded() if m["type"] != "chunk"}) == len(ids),
        10,
    )
    for _, _, message in replies.decoded():
        if message["type"] != "chunk":
            terminal.setdefault(message["id"], []).append(message)
    assert sorted(terminal) == sorted(ids), "every request the agent took is answered"
    assert all(len(v) == 1 for v in terminal.values()), "exactly one terminal message each"
    outcomes = {m[0].get("code", m[0]["type"]) for m in terminal.values()}
    assert outcomes <= {"end", "shutting_down"} and "shutting_down" in outcomes
    assert status.decoded()[-1][2]["state"] == "offline"
    assert "received SIGTERM" in stderr.text() and "stopped" in stderr.text()


def _scrape_or_none(url: str) -> str | None:
    try:
        return scrape(url, timeout=1)
    except OSError:
        return None


# -- SIGHUP -------------------------------------------------------------------------------------


def test_sighup_applies_log_level_and_qos_and_reports_what_needs_a_restart(
    tmp_path, broker, repository, processes, recorders
):
    base = base_config(tmp_path, broker.host, broker.port, repository)
    first = base + "[mqtt.qos]\nreply = 0\n[scheduler]\nworkers = 2\n"
    config = write_config(tmp_path / "agent.toml", 'log_level = "info"\n' + first)
    sink = NotifyListener()
    process, stderr = processes(config, env={"NOTIFY_SOCKET": sink.address})
    client = _client(broker, config)
    try:
        sink.wait_for("READY", "1", timeout=20)
        root = client.root
        replies = recorders(broker, f"{root}/result/#")
        events = recorders(broker, f"{root}/events")
        token = np.array([[1]], dtype=np.int64)
        list(
            client.request(
                "decoder", {"token": token}, request_id="before", params={"max_steps": 2}
            )
        )
        assert wait_until(lambda: len(replies.decoded("/before")) == 3, 5)
        assert {qos for _, qos, _ in replies.decoded("/before")} == {0}
        time.sleep(0.2)
        assert "request before" not in stderr.text()  # debug is off

        changed = base + "[mqtt.qos]\nreply = 2\n[scheduler]\nworkers = 3\n"
        write_config(config, 'log_level = "debug"\n' + changed)
        hup_at = time.monotonic()
        process.send_signal(signal.SIGHUP)
        sink.wait_for("RELOADING", "1", timeout=10, after=hup_at)
        ready_again = sink.wait_for("READY", "1", timeout=10, after=hup_at)
        assert "restart needed" in ready_again.fields["STATUS"]
        assert wait_until(
            lambda: any(m["type"] == "config_reloaded" for *_, m in events.decoded()), 5
        )
        reloaded = next(m for *_, m in events.decoded() if m["type"] == "config_reloaded")
        assert {"log_level", "mqtt.qos.reply"} <= set(reloaded["applied"])
        assert reloaded["restart_required"] == ["scheduler.workers"]
        assert stderr.wait_for("needs a restart to take effect: scheduler.workers")

        list(
            client.request("decoder", {"token": token}, request_id="after", params={"max_steps": 2})
        )
        assert wait_until(lambda: len(replies.decoded("/after")) == 3, 5)
        assert {qos for _, qos, _ in replies.decoded("/after")} == {2}
        assert stderr.wait_for("request after (decoder v1): ok")

        # A broken file changes nothing: the agent keeps serving with what it has.
        write_config(config, "log_level = 'loud'\n" + changed)
        process.send_signal(signal.SIGHUP)
        assert stderr.wait_for("still running with the previous one")
        list(
            client.request("decoder", {"token": token}, request_id="still", params={"max_steps": 2})
        )
        assert wait_until(lambda: len(replies.decoded("/still")) == 3, 5)
        # A file that is not UTF-8 (a Latin-1 comment) stopped the daemon: now one error.
        config.write_bytes(b"# caf\xe9\n" + changed.encode())
        process.send_signal(signal.SIGHUP)
        assert stderr.wait_for("not UTF-8 text")
        list(
            client.request("decoder", {"token": token}, request_id="latin", params={"max_steps": 2})
        )
        assert wait_until(lambda: len(replies.decoded("/latin")) == 3, 5)
        # An empty file (an editor's truncate-then-write, caught halfway) put every
        # reloadable key back to its default (reply QoS 1): now refused, QoS 2 kept.
        config.write_text("\n")
        process.send_signal(signal.SIGHUP)
        assert stderr.wait_for("the file is empty")
        list(
            client.request("decoder", {"token": token}, request_id="empty", params={"max_steps": 2})
        )
        assert wait_until(lambda: len(replies.decoded("/empty")) == 3, 5)
        assert {qos for _, qos, _ in replies.decoded("/empty")} == {2}
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    finally:
        client.close()
        sink.close()
    assert process.returncode == 0, stderr.text()[-3000:]


# -- secrets ------------------------------------------------------------------------------------


def test_a_secret_never_reaches_logs_check_config_metrics_or_telemetry(
    tmp_path, broker, repository, processes, recorders
):
    password = f"hunter2-{uuid.uuid4().hex}"
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "mqtt-password").write_text(password + "\n")
    key_path = tmp_path / "keys" / "very-secret-client.key"
    config_text = (
        base_config(tmp_path, broker.host, broker.port, repository)
        .replace("[mqtt]\n", '[mqtt]\nusername = "agent"\npassword_file = "mqtt-password"\n', 1)
        .replace("[models]\n", f'[mqtt.tls]\nkey_file = "{key_path}"\n[models]\n', 1)
    )
    config = write_config(tmp_path / "agent.toml", config_text)
    env = {"CREDENTIALS_DIRECTORY": str(creds), "EDGE_AGENT__TELEMETRY__INTERVAL_S": "0.3"}
    forbidden = (password, str(creds / "mqtt-password"), str(key_path))

    checked = run_cli("check-config", "--config", str(config), env=env)
    assert checked.returncode == 0, checked.stderr
    assert 'password_file = "***"' in checked.stdout and 'key_file = "***"' in checked.stdout
    process, stderr = processes(config, "--log-level", "debug", "--log-format", "json", env=env)
    client = _client(broker, config)
    try:
        everything = recorders(broker, f"{client.root}/#")
        _wait_online(everything)
        token = np.array([[1]], dtype=np.int64)
        # Even a request id that happens to be the password is masked in the log line.
        list(
            client.request(
                "decoder", {"token": token}, request_id=password, params={"max_steps": 1}
            )
        )
        assert stderr.wait_for("(decoder v1): ok")
        assert wait_until(lambda: len(everything.decoded("/telemetry")) >= 2, 5)
        metrics_text = scrape(_metrics_url(config))
        healthz = scrape(_metrics_url(config).replace("/metrics", "/healthz"))
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    finally:
        client.close()
    stderr.join()
    logs = stderr.text()
    assert process.returncode == 0, logs[-3000:]
    assert "***" in logs  # the request id line was masked, not dropped
    assert all(json.loads(line) for line in logs.splitlines())  # one JSON object per line
    published = [
        (topic, payload)
        for topic, _, payload in everything.messages
        # The test's own request and its reply stream carry the id that is the password.
        if "/result/" not in topic and "/infer/" not in topic
    ]
    assert any(topic.endswith("/telemetry") for topic, _ in published)
    for secret in forbidden:
        assert secret not in logs
        assert secret not in checked.stdout and secret not in checked.stderr
        assert secret not in metrics_text and secret not in healthz
        for topic, payload in published:
            assert secret.encode() not in payload, topic
    # The password came from the credentials directory (an unreadable file stops the start).
    assert "mqtt: connected" in logs


# -- the health command ---------------------------------------------------------------------------


def test_health_command_asks_the_running_agent(tmp_path, broker, repository, processes):
    config = write_config(
        tmp_path / "agent.toml", base_config(tmp_path, broker.host, broker.port, repository)
    )
    down = run_cli("health", "--config", str(config), timeout=10)
    assert down.returncode == 1 and "cannot reach" in down.stderr
    process, stderr = processes(config)
    assert wait_until(
        lambda: run_cli("health", "--config", str(config), timeout=10).returncode == 0, 20
    ), stderr.text()[-2000:]
    result = run_cli("health", "--config", str(config), timeout=10)
    body = json.loads(result.stdout)
    assert body["ok"] is True and body["problem"] is None
    process.send_signal(signal.SIGTERM)
    process.wait(30)
    assert process.returncode == 0


def test_plan_reload_applies_the_safe_keys_and_lists_the_rest(tmp_path):
    from agent.service.agent import plan_reload

    path = tmp_path / "agent.toml"
    path.write_text('device_id = "a"\n')
    old = load_config(path, {})
    path.write_text(
        'device_id = "b"\nlog_level = "debug"\n[mqtt]\nport = 1884\n[mqtt.qos]\nevent = 0\n'
        "request_subscription = 2\n[limits]\nmax_depth = 4\n[telemetry]\ninterval_s = 5\n"
        "[systemd]\nstuck_after_s = 30\n[metrics]\nport = 9999\n"
    )
    new = load_config(path, {})
    merged, applied, restart = plan_reload(old, new)
    assert sorted(applied) == [
        "limits.max_depth",
        "log_level",
        "mqtt.qos.event",
        "systemd.stuck_after_s",
        "telemetry.interval_s",
    ]
    assert sorted(restart) == [
        "device_id",
        "metrics.port",
        "mqtt.port",
        "mqtt.qos.request_subscription",
    ]
    assert merged.log_level == "debug" and merged.mqtt.qos.event == 0
    assert merged.limits.max_depth == 4 and merged.systemd.stuck_after_s == 30
    assert merged.device_id == "a" and merged.mqtt.port == 1883 and merged.metrics.port == 9842
    assert merged.mqtt.qos.request_subscription == 1
    assert plan_reload(old, old) == (old, [], [])
