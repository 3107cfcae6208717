"""Shared fixtures: a private Mosquitto per test module, agents and clients on unique topics."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient
from agent.config import AgentConfig, load_config
from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.mqtt.paho_fast import PLAIN_ENV
from agent.service.agent import Agent

OUR_THREADS = (
    "mqtt-",
    "spool-writer",
    "infer-worker",
    "housekeeping",
    "drain-timer",
    "paho-mqtt-client",
    "model-watcher",
    "metrics-http",
    "engine-build",  # and engine-build-ticker
    "source-",
)

DECODER_CONFIG = """\
[stream]
mode = "steps"
max_steps = 32
feed = { token = "next_token" }
state = { h = "h_out" }
stop = { output = "next_token", value = 0 }
emit = ["next_token"]
"""

MLP_CONFIG = """\
[stream]
mode = "batch"
micro_batch = 4
"""


@pytest.fixture(scope="module")
def broker() -> Iterator[EmbeddedBroker]:
    """A Mosquitto of this test module's own, on a free port."""
    with EmbeddedBroker() as b:
        yield b


@pytest.fixture
def own_broker() -> Iterator[EmbeddedBroker]:
    """A Mosquitto for one test, to stop, kill or restart."""
    with EmbeddedBroker() as b:
        yield b


def write_repository(root: Path) -> Path:
    """decoder (steps), mlp (batch, micro_batch 4) and classifier (whole), version 1 each."""
    (root / "decoder" / "1").mkdir(parents=True)
    demo_models.save(demo_models.gru_decoder(), root / "decoder" / "1" / "model.onnx")
    (root / "decoder" / "config.toml").write_text(DECODER_CONFIG)
    (root / "mlp" / "1").mkdir(parents=True)
    demo_models.save(demo_models.mlp(), root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.toml").write_text(MLP_CONFIG)
    (root / "classifier" / "1").mkdir(parents=True)
    demo_models.save(demo_models.conv_net(), root / "classifier" / "1" / "model.onnx")
    return root


def write_long_decoder(root: Path, max_steps: int = 5000) -> Path:
    """A decoder whose streams can run for thousands of steps (for outage and crash tests)."""
    from agent.demo.run import DECODER_CONFIG

    (root / "decoder" / "1").mkdir(parents=True)
    demo_models.save(
        demo_models.gru_decoder(vocab=512, embed=64, hidden=256),
        root / "decoder" / "1" / "model.onnx",
    )
    (root / "decoder" / "config.toml").write_text(DECODER_CONFIG.format(steps=max_steps))
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("models"))


def unique_device() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def agent_config(
    tmp: Path, broker: EmbeddedBroker, repository: Path, toml: str = "", **env: Any
) -> AgentConfig:
    """A config file in `tmp` pointing at `broker` and `repository`; `env` as overrides."""
    path = tmp / f"agent-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(
        f'device_id = "{unique_device()}"\n'
        f'state_dir = "{tmp / "state"}"\n'
        f"{toml}\n"
        f'[models]\nrepository = "{repository}"\n'
    )
    environ = {
        "EDGE_AGENT__MQTT__HOST": f'"{broker.host}"',
        "EDGE_AGENT__MQTT__PORT": str(broker.port),
        "EDGE_AGENT__TELEMETRY__INTERVAL_S": "0",
        "EDGE_AGENT__MODELS__SETTLE_S": "0.1",
        "EDGE_AGENT__METRICS__PORT": "0",  # every agent its own free port
        **{f"EDGE_AGENT__{k.upper()}": v for k, v in env.items()},
    }
    return load_config(path, environ)


def serve_agent(
    broker: EmbeddedBroker, config: AgentConfig, ready_s: float = 10
) -> Iterator[tuple[Agent, AgentClient]]:
    """For a module fixture's `yield from`: an agent started on `config` and a client of it on
    `broker`, ready within `ready_s`; both closed after."""
    agent = Agent(config)
    agent.start()
    client = AgentClient(broker.host, broker.port, device_id=agent.config.device_id).connect()
    try:
        assert agent.wait_ready(ready_s)
        yield agent, client
    finally:
        client.close()
        agent.stop()


@pytest.fixture
def start_agent() -> Iterator[Callable[[AgentConfig], Agent]]:
    """Start agents on configs made beforehand (so state can be prepared); stopped after."""
    agents: list[Agent] = []

    def start(config: AgentConfig) -> Agent:
        agent = Agent(config)
        agents.append(agent)
        agent.start()
        assert agent.wait_ready(10), "agent did not connect"
        return agent

    yield start
    for agent in agents:
        agent.stop()


@pytest.fixture
def make_agent(tmp_path: Path, start_agent: Callable[[AgentConfig], Agent]) -> Callable[..., Agent]:
    """Start agents with `make_agent(broker, repository, toml=..., **env)`; stopped after."""

    def make(broker: EmbeddedBroker, repository: Path, toml: str = "", **env: Any) -> Agent:
        return start_agent(agent_config(tmp_path, broker, repository, toml, **env))

    return make


@pytest.fixture(params=["fast", "plain"])
def paho_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the fast paho client and with paho's own (the fallback)."""
    if request.param == "plain":
        monkeypatch.setenv(PLAIN_ENV, "plain")
    else:
        monkeypatch.delenv(PLAIN_ENV, raising=False)
    return str(request.param)


@pytest.fixture
def make_client() -> Iterator[Callable[..., AgentClient]]:
    clients: list[AgentClient] = []

    def make(broker: EmbeddedBroker, agent: Agent, protocol: str = "5") -> AgentClient:
        client = AgentClient(
            broker.host,
            broker.port,
            device_id=agent.config.device_id,
            topic_prefix=agent.config.mqtt.topic_prefix,
            protocol=protocol,
        ).connect()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every thread the agent or the SDK starts is joined when they stop."""
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 5
    while True:
        leaked = [
            t.name
            for t in threading.enumerate()
            if t.ident not in before and t.name.startswith(OUR_THREADS) and t.is_alive()
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads left running: {leaked}"


def decoder_reference(steps: int, token: int = 1, batch: int = 1) -> list[np.ndarray]:
    """The decoder's tokens computed by running the ONNX model directly, step by step."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        demo_models.to_bytes(demo_models.gru_decoder()), providers=["CPUExecutionProvider"]
    )
    tok = np.full((batch, 1), token, dtype=np.int64)
    hidden = session.get_inputs()[1].shape[1]
    h = np.zeros((batch, hidden), dtype=np.float32)
    out = []
    for _ in range(steps):
        next_token, _logits, h = session.run(
            ["next_token", "logits", "h_out"], {"token": tok, "h": h}
        )
        out.append(next_token)
        tok = next_token
    return out
