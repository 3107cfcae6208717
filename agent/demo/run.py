"""`edge-agent demo`: the whole path on one box, and the number that matters to a backend.

It builds a GRU decoder step in code (sized so that a step costs about what a small language
model's does on an edge CPU), serves it from a temporary model repository, starts a
private Mosquitto when no broker is given, runs the agent in this process, and sends the
same 32-step request streamed and with `stream: false`, printing when each chunk arrived.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from agent.client import AgentClient
from agent.config import load_config
from agent.demo import models as demo_models
from agent.demo.broker import BrokerError, EmbeddedBroker
from agent.service.agent import Agent

DEMO_VOCAB, DEMO_EMBED, DEMO_HIDDEN = 4096, 256, 1024

DECODER_CONFIG = """\
[stream]
mode = "steps"
max_steps = {steps}
feed = {{ token = "next_token" }}
state = {{ h = "h_out" }}
emit = ["next_token"]
"""


def make_demo_repository(root: Path, steps: int) -> Path:
    models = root / "models"
    (models / "decoder" / "1").mkdir(parents=True)
    model = demo_models.gru_decoder(vocab=DEMO_VOCAB, embed=DEMO_EMBED, hidden=DEMO_HIDDEN)
    demo_models.save(model, models / "decoder" / "1" / "model.onnx")
    (models / "decoder" / "config.toml").write_text(DECODER_CONFIG.format(steps=steps))
    return models


def run_demo(host: str | None, port: int, steps: int, repeats: int) -> int:
    with tempfile.TemporaryDirectory(prefix="edge-agent-demo-") as tmp:
        workdir = Path(tmp)
        broker = None
        if host is None:
            try:
                broker = EmbeddedBroker().start()
            except BrokerError as e:
                print(f"error: {e}")
                return 1
            host, port = broker.host, broker.port
            print(f"started a private mosquitto on {host}:{port}")
        models = make_demo_repository(workdir, steps)
        config = load_config(
            None,
            {
                "EDGE_AGENT__DEVICE_ID": '"demo"',
                "EDGE_AGENT__STATE_DIR": f'"{workdir / "state"}"',
                "EDGE_AGENT__MQTT__HOST": f'"{host}"',
                "EDGE_AGENT__MQTT__PORT": str(port),
                "EDGE_AGENT__MODELS__REPOSITORY": f'"{models}"',
                "EDGE_AGENT__TELEMETRY__INTERVAL_S": "0",
                "EDGE_AGENT__MODELS__SETTLE_S": "0",  # written above, complete: no wait
                "EDGE_AGENT__METRICS__PORT": "0",
            },
        )
        agent = Agent(config)
        started = time.perf_counter()
        agent.start()
        try:
            if not agent.wait_ready(10):
                print(f"error: the agent could not connect to {host}:{port}")
                return 1
            print(
                f"agent ready in {(time.perf_counter() - started) * 1000:.0f} ms; "
                f"model 'decoder' (GRU step: vocab {DEMO_VOCAB}, hidden {DEMO_HIDDEN}), "
                f"{steps} steps"
            )
            with AgentClient(host, port, device_id="demo") as client:
                return _show(client, steps, repeats)
        finally:
            agent.stop()
            if broker is not None:
                broker.close()


def _show(client: AgentClient, steps: int, repeats: int) -> int:
    inputs = {"token": np.array([[1]], dtype=np.int64)}
    print("\nstreamed request (each line is printed the moment its chunk arrives):")
    reply = client.request("decoder", inputs, timeout=10)
    tokens = []
    for chunk in reply:
        token = int(chunk.outputs["next_token"].reshape(-1)[0])
        tokens.append(token)
        ms = (chunk.received - reply.sent_at) * 1000
        print(f"  {ms:8.2f} ms  step {chunk.index:2d}  token {token}")
    assert reply.end is not None and reply.end.chunks == steps

    first, last, whole = [], [], []
    for _ in range(repeats):
        reply = client.request("decoder", inputs, timeout=10)
        arrivals = [c.received for c in reply]
        first.append(arrivals[0] - reply.sent_at)
        last.append(arrivals[-1] - reply.sent_at)
        reply = client.request("decoder", inputs, stream=False, timeout=10)
        reply.collect()
        whole.append(time.perf_counter() - reply.sent_at)
    ttfc, ttl, full = (statistics.median(x) * 1000 for x in (first, last, whole))
    print(f"\nmedian of {repeats} requests:")
    print(f"  time to first chunk (streamed)     {ttfc:8.2f} ms")
    print(f"  time to last chunk (streamed)      {ttl:8.2f} ms")
    print(f"  time to whole result (stream=false){full:8.2f} ms")
    print(f"  first chunk / whole result         {ttfc / full:8.2f}")
    return 0


__all__ = ["make_demo_repository", "run_demo"]
