"""Models exported by `torch.onnx.export` as it behaves by default since torch 2.9 (the dynamo
exporter: opset 18 or later, weights in `model.onnx.data` beside the graph), dropped into a
models folder as a user brings them, in each streaming mode: `whole` (a CNN classifier),
`steps` (a GRU decoder step fed back) and `scan` (a conv + LSTM VAD over silero's windows, its
state carried, from a request and from a pcm source). Each answers as torch did: the fixtures
(`scripts/make_dynamo_models.py`) hold torch's own outputs for the whole stream."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent
from tests.test_sources import Subscriber, outputs, unique_seqs

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real" / "torch_dynamo"
MODELS = ("classifier", "decoder_step", "vad")
TOLERANCE = 1e-5
HOP, LEAD = 512, 64
DynamoAgent = tuple[Agent, AgentClient, Subscriber]


def reference(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the request's inputs, torch's outputs) of a fixture."""
    with np.load(FIXTURES / name / "reference.npz", allow_pickle=False) as data:
        inputs = {k[3:]: data[k] for k in data.files if k.startswith("in.")}
        outputs = {k[4:]: data[k] for k in data.files if k.startswith("out.")}
    return inputs, outputs


@pytest.fixture(scope="module")
def dynamo_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DynamoAgent]:
    """An agent serving the three, with a pcm source `mic` reading the vad's 16-bit
    recording through `vad` (its stream subscribed before the agent starts)."""
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("dynamo")
    root = tmp / "models"
    for name in MODELS:
        (root / name / "1").mkdir(parents=True)
        for file in ("model.onnx", "model.onnx.data"):
            shutil.copy(FIXTURES / name / file, root / name / "1" / file)
        shutil.copy(FIXTURES / name / "config.toml", root / name / "config.toml")
    recording = tmp / "speech.s16"
    recording.write_bytes(reference("vad")[0]["pcm"].tobytes())
    source = (
        '[[sources]]\nname = "mic"\nkind = "pcm"\nmodel = "vad"\n'
        f'path = "{recording}"\nformat = "s16le"\nsample_rate = 16000\n'
    )
    config = agent_config(tmp, broker, root, source)
    stream = Subscriber(broker, f"{config.root_topic}/stream/mic")
    try:
        for agent, client in serve_agent(broker, config):
            yield agent, client, stream
    finally:
        stream.close()


@pytest.mark.parametrize("name", MODELS)
def test_the_export_keeps_its_weights_apart_and_loads(dynamo_agent: DynamoAgent, name: str) -> None:
    graph = onnx.load(str(FIXTURES / name / "model.onnx"), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.graph.initializer), (
        "the fixture is meant to hold its weights in model.onnx.data"
    )
    assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 18
    agent, _, _ = dynamo_agent
    entry = agent.models.inventory()["models"][name]["versions"]["1"]
    assert entry["state"] == "ready", entry.get("error")


def test_a_classifier_answers_as_torch(dynamo_agent: DynamoAgent) -> None:
    _, client, _ = dynamo_agent
    inputs, want = reference("classifier")
    outputs = client.request("classifier", inputs, timeout=30).collect()
    np.testing.assert_allclose(outputs["probs"], want["probs"], atol=TOLERANCE, rtol=0)


def test_a_decoder_step_streams_the_tokens_of_torchs_loop(
    dynamo_agent: DynamoAgent,
) -> None:
    _, client, _ = dynamo_agent
    inputs, want = reference("decoder_step")
    reply = client.request("decoder_step", inputs, timeout=30)
    chunks = list(reply)
    assert [c.index for c in chunks] == list(range(len(want["next_token"])))
    for chunk, token, logits in zip(chunks, want["next_token"], want["logits"], strict=True):
        np.testing.assert_array_equal(chunk.outputs["next_token"], token)
        np.testing.assert_allclose(chunk.outputs["logits"], logits, atol=TOLERANCE, rtol=0)


def test_a_scan_carries_the_state_as_torchs_loop(
    dynamo_agent: DynamoAgent,
) -> None:
    _, client, _ = dynamo_agent
    inputs, want = reference("vad")
    reply = client.request("vad", {"input": inputs["input"]}, timeout=30)
    chunks = list(reply)
    assert [c.index for c in chunks] == list(range(len(want["prob"])))  # the partial one dropped
    assert [c.offset for c in chunks] == [k * HOP for k in range(len(chunks))]
    got = np.stack([c.outputs["prob"] for c in chunks])
    np.testing.assert_allclose(got, want["prob"], atol=TOLERANCE, rtol=0)


def test_a_pcm_source_carries_the_state_as_torchs_loop(dynamo_agent: DynamoAgent) -> None:
    _, _, stream = dynamo_agent
    _, want = reference("vad")
    windows = len(want["pcm_prob"])
    assert stream.wait_for(lambda ms: len(unique_seqs(ms)) >= windows, 30), stream.messages
    chunks = [unique_seqs([m for _, _, m in stream.messages])[s] for s in range(windows)]
    assert [m["offset"] for m in chunks] == [k * HOP for k in range(windows)]
    got = np.stack([outputs(m)["prob"] for m in chunks])
    np.testing.assert_allclose(got, want["pcm_prob"], atol=TOLERANCE, rtol=0)
