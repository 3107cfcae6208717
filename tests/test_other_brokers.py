"""The agent against amqtt, a broker that speaks MQTT 3.1.1 only and keeps no session across
a restart. Skipped where amqtt is not installed (`pip install amqtt` in a venv of its own;
`EDGE_AGENT_AMQTT` names the `amqtt` command when it is not on the PATH)."""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.config import AgentConfig
from agent.demo.broker import EmbeddedBroker, free_port
from agent.protocol.payload import encode_payload
from agent.service.agent import Agent
from tests.conftest import agent_config


def find_amqtt() -> str | None:
    for candidate in (
        os.environ.get("EDGE_AGENT_AMQTT"),
        shutil.which("amqtt"),
        "/tmp/amqtt-venv/bin/amqtt",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


AMQTT = find_amqtt()
pytestmark = pytest.mark.skipif(AMQTT is None, reason="amqtt is not installed")


class Amqtt(EmbeddedBroker):
    """amqtt on a free loopback port, with `restart` as EmbeddedBroker has it."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(free_port(), workdir=workdir)
        self._amqtt: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> Amqtt:
        config = self.workdir / "amqtt.yaml"
        config.write_text(
            "listeners:\n  default:\n    type: tcp\n"
            f"    bind: 127.0.0.1:{self.port}\n"
            "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        with (self.workdir / "amqtt.log").open("ab") as log:
            self._amqtt = subprocess.Popen(
                [str(AMQTT), "-c", str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("amqtt did not listen")

    @property
    def running(self) -> bool:
        return self._amqtt is not None and self._amqtt.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        process, self._amqtt = self._amqtt, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def amqtt(tmp_path: Path) -> Iterator[Amqtt]:
    (tmp_path / "amqtt").mkdir()
    broker = Amqtt(tmp_path / "amqtt").start()
    yield broker
    broker.stop()


def test_stream_restart_and_lost_session_on_amqtt(
    amqtt: Amqtt,
    make_agent: Callable[..., Agent],
    make_client: Callable[..., object],
    repository: Path,
) -> None:
    agent = make_agent(
        amqtt,
        repository,
        MQTT__PROTOCOL='"3.1.1"',
        MQTT__RECONNECT_MIN_S="0.2",
        MQTT__RECONNECT_MAX_S="0.5",
    )
    client = make_client(amqtt, agent, protocol="3.1.1")
    token = {"token": np.array([[1]], dtype=np.int64)}
    first = client.request("decoder", token, params={"max_steps": 6})  # type: ignore[attr-defined]
    chunks = list(first)
    assert [chunk.index for chunk in chunks] == list(range(6))
    amqtt.stop()
    amqtt.start()
    deadline = time.monotonic() + 20
    while agent.transport.sessions_lost == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.transport.sessions_lost == 1  # amqtt keeps no session across a restart
    assert agent.counters["broker_session_lost"] == 1
    # After the restart: a new stream, and a resend of the first one from the agent's spool.
    again = make_client(amqtt, agent, protocol="3.1.1")
    assert len(list(again.request("decoder", token, params={"max_steps": 3}))) == 3  # type: ignore[attr-defined]
    resent: queue.Queue[dict[str, Any]] = queue.Queue()
    again.listen(first.topic, lambda topic, message, raw: resent.put(message or {}))  # type: ignore[attr-defined]
    ask = encode_payload({"id": first.request_id, "from_seq": 0})
    again.publish_raw(f"{agent.root}/resend", ask)  # type: ignore[attr-defined]
    seqs = sorted(resent.get(timeout=10)["seq"] for _ in range(7))  # 6 chunks and the end
    assert seqs == list(range(7))


def test_mqtt5_against_amqtt_says_which_setting(
    amqtt: Amqtt,
    tmp_path: Path,
    repository: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config: AgentConfig = agent_config(tmp_path, amqtt, repository)
    agent = Agent(config)
    agent.start()
    try:
        deadline = time.monotonic() + 20  # amqtt waits for the rest of the CONNECT: 10 s
        while "protocol" not in (agent.transport.last_error or ""):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert '[mqtt] protocol = "3.1.1"' in (agent.transport.last_error or "")
        assert "TLS" not in (agent.transport.last_error or "")
    finally:
        agent.stop()
