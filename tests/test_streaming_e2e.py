"""A request's whole path against a real Mosquitto and real ONNX models, both MQTT versions."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from agent.client import AgentClient, AgentError, ReplyTimeout
from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.protocol.errors import Limits
from agent.protocol.payload import decode_payload, encode_payload
from agent.protocol.replies import reply_envelope
from tests.conftest import decoder_reference


def _collect(client: AgentClient, topic: str) -> queue.Queue[dict]:
    messages: queue.Queue[dict] = queue.Queue()
    client.listen(topic, lambda t, m, raw: messages.put({"topic": t, **(m or {})}))
    return messages


def _drain(messages: queue.Queue[dict], until: float = 0.5) -> list[dict]:
    out = []
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        try:
            out.append(messages.get(timeout=0.05))
        except queue.Empty:
            continue
    return out


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_decoder_streams_32_steps_equal_to_direct_run(
    broker, repository, make_agent, make_client, protocol
):
    agent = make_agent(broker, repository, MQTT__PROTOCOL=f'"{protocol}"')
    client = make_client(broker, agent, protocol=protocol)
    reply = client.request("decoder", {"token": np.array([[1]], dtype=np.int64)})
    chunks = list(reply)
    assert [c.seq for c in chunks] == list(range(32))
    assert [c.index for c in chunks] == list(range(32))
    assert reply.end is not None and reply.end.chunks == 32
    assert set(reply.end.timing) == {"queue_ms", "infer_ms", "total_ms"}
    expected = decoder_reference(32)
    for chunk, want in zip(chunks, expected, strict=True):
        assert list(chunk.outputs) == ["next_token"]
        np.testing.assert_array_equal(chunk.outputs["next_token"], want)
        assert chunk.version == 1 and chunk.model == "decoder"
    assert reply.duplicates == 0


def test_raw_reply_messages_follow_the_contract(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    topic = f"{agent.root}/result/decoder/raw-1"
    messages = _collect(client, topic)
    payload = encode_payload(
        {
            "id": "raw-1",
            "inputs": {"token": np.array([[1]], dtype=np.int64)},
            "params": {"max_steps": 3},
        }
    )
    client.publish_raw(f"{agent.root}/infer/decoder", payload)
    got = _drain(messages, 1.0)
    assert [m["type"] for m in got] == ["chunk", "chunk", "chunk", "end"]
    for seq, message in enumerate(got):
        assert message["v"] == 1 and message["id"] == "raw-1" and message["seq"] == seq
        assert message["model"] == "decoder" and message["version"] == 1
        assert isinstance(message["ts"], int) and message["ts"] > 1_600_000_000 * 10**9
    token = got[0]["outputs"]["token" if "token" in got[0]["outputs"] else "next_token"]
    assert token.tag == 40  # RFC 8746 multi-dimensional array
    shape, typed = token.value
    assert list(shape) == [1, 1] and typed.tag == 79  # int64 little-endian
    assert got[-1]["chunks"] == 3


def test_batch_mode_slices_of_four(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    x = np.random.default_rng(1).standard_normal((10, 16)).astype(np.float32)
    reply = client.request("mlp", {"x": x})
    chunks = list(reply)
    assert [c.index for c in chunks] == [0, 4, 8]
    assert [c.outputs["y"].shape[0] for c in chunks] == [4, 4, 2]
    session = ort.InferenceSession(demo_models.to_bytes(demo_models.mlp()))
    (direct,) = session.run(["y"], {"x": x})
    np.testing.assert_allclose(np.concatenate([c.outputs["y"] for c in chunks]), direct, rtol=1e-5)
    assert reply.end.chunks == 3


def test_stream_false_gives_one_result(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    topic = f"{agent.root}/result/decoder/whole-1"
    messages = _collect(client, topic)
    reply = client.request(
        "decoder", {"token": np.array([[1]], dtype=np.int64)}, stream=False, request_id="whole-1"
    )
    outputs = reply.collect()
    assert reply.result is not None
    assert outputs["next_token"].shape == (32, 1, 1)
    np.testing.assert_array_equal(outputs["next_token"], np.stack(decoder_reference(32)))
    got = _drain(messages, 0.3)
    assert [m["type"] for m in got] == ["result"]
    assert set(got[0]["timing"]) == {"queue_ms", "infer_ms", "total_ms"}


def test_whole_mode_classifier(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    image = np.random.default_rng(2).standard_normal((2, 3, 32, 32)).astype(np.float32)
    reply = client.request("classifier", {"image": image})
    chunks = list(reply)
    assert len(chunks) == 1 and chunks[0].index == 0
    session = ort.InferenceSession(demo_models.to_bytes(demo_models.conv_net()))
    (direct,) = session.run(None, {"image": image})
    np.testing.assert_allclose(chunks[0].outputs["scores"], direct, rtol=1e-5)


def test_large_chunks_travel_as_parts(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository, LIMITS__MAX_CHUNK_BYTES="2048")
    client = make_client(broker, agent)
    topic = f"{agent.root}/result/classifier/parts-1"
    messages = _collect(client, topic)
    image = np.random.default_rng(3).standard_normal((64, 3, 32, 32)).astype(np.float32)
    reply = client.request("classifier", {"image": image}, request_id="parts-1")
    chunks = list(reply)
    session = ort.InferenceSession(demo_models.to_bytes(demo_models.conv_net()))
    (direct,) = session.run(None, {"image": image})
    assert len(chunks) == 1
    np.testing.assert_allclose(chunks[0].outputs["scores"], direct, rtol=1e-5)
    raw = _drain(messages, 0.3)
    parts = [m for m in raw if m["type"] == "chunk"]
    assert len(parts) > 1
    assert [m["part"] for m in parts] == [[k, len(parts)] for k in range(len(parts))]
    assert [m["seq"] for m in raw] == list(range(len(raw)))
    assert raw[-1]["type"] == "end" and raw[-1]["chunks"] == len(parts)
    assert all(len(encode_payload(m | {"topic": ""})) < 2048 + 64 for m in parts)


def test_status_and_inventory_are_retained(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    time.sleep(0.2)
    client = make_client(broker, agent)
    status = _collect(client, f"{agent.root}/status")
    models = _collect(client, f"{agent.root}/models")
    (online,) = _drain(status, 0.3)
    assert online["state"] == "online" and online["device"] == agent.config.device_id
    assert online["epoch"] >= 1 and "agent_version" in online and "started_at" in online
    inventory = _drain(models, 0.3)[-1]
    decoder = inventory["models"]["decoder"]
    assert decoder["serving"] == 1
    assert decoder["versions"]["1"]["state"] == "ready"
    assert decoder["versions"]["1"]["backend"] == "onnxruntime"
    assert decoder["versions"]["1"]["providers"] == ["CPUExecutionProvider"]
    agent.stop()
    offline = _drain(status, 0.5)
    assert offline and offline[-1]["state"] == "offline" and offline[-1]["epoch"] == online["epoch"]


def test_will_and_epoch_across_a_broker_restart(own_broker, repository, make_agent, make_client):
    agent = make_agent(
        own_broker, repository, MQTT__RECONNECT_MIN_S="0.1", MQTT__RECONNECT_MAX_S="0.5"
    )
    first = agent.epoch
    own_broker.stop()
    own_broker.start()
    deadline = time.monotonic() + 10
    while agent.epoch == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.epoch == first + 1
    client = make_client(own_broker, agent)
    assert len(list(client.request("decoder", {"token": np.array([[1]], dtype=np.int64)}))) == 32
    status = _collect(client, f"{agent.root}/status")
    assert _drain(status, 0.3)[-1]["epoch"] == first + 1


def test_errors_carry_contract_codes(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    token = {"token": np.array([[1]], dtype=np.int64)}
    cases = [
        ("nosuch", token, {}, "unknown_model"),
        ("decoder", token, {"version": 7}, "unknown_version"),
        ("decoder", {"token": np.array([[1.0]], dtype=np.float32)}, {}, "bad_request"),
        ("decoder", {}, {}, "bad_request"),
        ("decoder", token, {"params": {"max_steps": 999}}, "bad_request"),
        ("decoder", token, {"deadline_ms": 0}, "deadline_exceeded"),
    ]
    for model, inputs, options, code in cases:
        with pytest.raises(AgentError) as info:
            list(client.request(model, inputs, timeout=5, **options))
        assert info.value.code == code, (model, options, info.value)


def test_pinned_version_and_max_steps(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    reply = client.request(
        "decoder", {"token": np.array([[1]], dtype=np.int64)}, version=1, params={"max_steps": 5}
    )
    assert len(list(reply)) == 5 and reply.version == 1


def test_reply_to_and_mqtt5_correlation(broker, repository, make_agent, make_client):
    # Reply topics outside the device's own result tree are an explicit choice.
    toml = '[mqtt]\nallowed_reply_prefixes = ["edge/backend-7/", "edge/rt/"]'
    agent = make_agent(broker, repository, toml=toml)
    client = make_client(broker, agent)
    reply_topic = f"{agent.config.mqtt.topic_prefix}/backend-7/replies"
    reply = client.request(
        "decoder",
        {"token": np.array([[1]], dtype=np.int64)},
        reply_to=reply_topic,
        params={"max_steps": 2},
    )
    assert len(list(reply)) == 2
    # A forbidden reply_to is answered on the default reply topic.
    default = _collect(client, f"{agent.root}/result/decoder/bad-reply")
    body = {
        "id": "bad-reply",
        "inputs": {"token": np.array([[1]], dtype=np.int64)},
        "reply_to": "elsewhere/x",
    }
    client.publish_raw(f"{agent.root}/infer/decoder", encode_payload(body))
    (error,) = _drain(default, 0.5)
    assert error["type"] == "error" and error["code"] == "bad_request"
    assert "reply_to" in error["message"]

    # MQTT 5: the Response Topic property counts as reply_to; Correlation Data is echoed.
    import paho.mqtt.client as mqtt

    received: queue.Queue = queue.Queue()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    sub.on_message = lambda c, u, m: received.put(m)
    sub.connect(broker.host, broker.port)
    sub.loop_start()
    try:
        response_topic = f"{agent.config.mqtt.topic_prefix}/rt/{time.time_ns()}"
        sub.subscribe(response_topic, 1)
        time.sleep(0.2)
        props = client.response_properties(response_topic, b"\x01corr")
        body = {
            "id": "corr-1",
            "inputs": {"token": np.array([[1]], dtype=np.int64)},
            "params": {"max_steps": 2},
        }
        client.publish_raw(f"{agent.root}/infer/decoder", encode_payload(body), 1, props)
        messages = [received.get(timeout=5) for _ in range(3)]
        assert all(m.properties.CorrelationData == b"\x01corr" for m in messages)
        types = [decode_payload(m.payload, Limits())["type"] for m in messages]
        assert types == ["chunk", "chunk", "end"]
        # A repeat of that request (same layout and response topic, other correlation data)
        # is read from its bytes: its replies carry its own id and correlation data.
        repeats = agent.telemetry()["counters"].get("requests_layout_repeats", 0)
        props = client.response_properties(response_topic, b"\x02corr")
        body["id"] = "corr-2"
        client.publish_raw(f"{agent.root}/infer/decoder", encode_payload(body), 1, props)
        messages = [received.get(timeout=5) for _ in range(3)]
        assert all(m.properties.CorrelationData == b"\x02corr" for m in messages)
        ids = {decode_payload(m.payload, Limits())["id"] for m in messages}
        assert ids == {"corr-2"}
        assert agent.telemetry()["counters"]["requests_layout_repeats"] == repeats + 1
    finally:
        sub.disconnect()
        sub.loop_stop()


def test_overload_answers_every_request_once(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository, SCHEDULER__WORKERS="1", SCHEDULER__QUEUE_SIZE="2")
    client = make_client(broker, agent)
    messages = _collect(client, f"{agent.root}/result/mlp/+")
    x = np.random.default_rng(0).standard_normal((256, 16)).astype(np.float32)
    payloads = [encode_payload({"id": f"load-{i}", "inputs": {"x": x}}) for i in range(40)]
    for payload in payloads:  # back to back, faster than one worker can serve them
        client.publish_raw(f"{agent.root}/infer/mlp", payload, qos=0)
    terminal: dict[str, dict] = {}
    chunks: dict[str, int] = {}
    deadline = time.monotonic() + 20
    while len(terminal) < 40 and time.monotonic() < deadline:
        for message in _drain(messages, 0.2):
            if message["type"] == "chunk":
                chunks[message["id"]] = chunks.get(message["id"], 0) + 1
            else:
                assert message["id"] not in terminal, "two terminal messages"
                terminal[message["id"]] = message
    assert len(terminal) == 40
    outcomes = {m["type"] if m["type"] == "end" else m["code"] for m in terminal.values()}
    assert outcomes == {"end", "overloaded"}
    for rid, message in terminal.items():
        if message["type"] == "end":
            assert message["chunks"] == chunks[rid] == 64


def test_sdk_drops_duplicates_and_times_out(broker, repository, make_agent, make_client):
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    reply = client.request(
        "decoder",
        {"token": np.array([[1]], dtype=np.int64)},
        params={"max_steps": 2},
        request_id="dup-1",
    )
    time.sleep(0.3)  # the agent has answered; now a broker redelivers a message
    duplicate = encode_payload(
        reply_envelope(
            request_id="dup-1",
            seq=0,
            type="chunk",
            model="decoder",
            version=1,
            index=0,
            outputs={"next_token": np.array([[5]], dtype=np.int64)},
        )
    )
    client.publish_raw(reply.topic, duplicate)
    assert len(list(reply)) == 2
    # No agent answers for this device: the stream stays quiet and the SDK says so.
    with (
        AgentClient(broker.host, broker.port, device_id="nobody-home") as lonely,
        pytest.raises(ReplyTimeout),
    ):
        list(lonely.request("decoder", {"token": np.array([[1]], dtype=np.int64)}, timeout=0.3))


def test_models_folder_path_resolves_relative_to_config(tmp_path: Path, broker):
    from agent.config import load_config

    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "agent.toml"
    path.write_text('[models]\nrepository = "models"\n')
    assert load_config(path, {}).models.repository == tmp_path / "conf" / "models"


def test_embedded_broker_restart_keeps_port():
    with EmbeddedBroker() as b:
        port = b.port
        b.kill()
        assert not b.running
        b.start()
        assert b.running and b.port == port


def test_requests_that_repeat_a_layout_each_get_their_own_answer(
    broker, repository, make_agent, make_client
):
    """Same keys, shapes and options with new ids and data: the agent reads such repeats from
    their bytes (agent.protocol.layouts). Each answer must still be its own request's, and a
    repeat whose id the contract refuses is refused as the full decoding refuses it."""
    agent = make_agent(broker, repository)
    client = make_client(broker, agent)
    events = _collect(client, f"{agent.root}/events")
    model = str(repository / "classifier" / "1" / "model.onnx")
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    g = np.random.default_rng(12)
    images = [g.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(6)]
    replies = [client.request("classifier", {"image": x}, stream=False) for x in images]
    for image, reply in zip(images, replies, strict=True):
        want = session.run(None, {"image": image})[0]
        np.testing.assert_allclose(reply.collect()["scores"], want, rtol=1e-5, atol=1e-6)
    assert agent.telemetry()["counters"]["requests_layout_repeats"] >= 4

    # The same layout (16-character id, same image size) with an id the contract refuses.
    bad = encode_payload(
        {"id": "not a valid id!!", "inputs": {"image": images[0]}, "stream": False}
    )
    client.publish_raw(f"{agent.root}/infer/classifier", bad)
    reasons = []
    deadline = time.monotonic() + 5
    while not reasons and time.monotonic() < deadline:
        reasons = [e["reason"] for e in _drain(events, 0.2) if e.get("type") == "bad_request"]
    assert reasons and "id" in reasons[0]
    good = client.infer("classifier", {"image": images[1]}, stream=False)
    np.testing.assert_array_equal(good["scores"], replies[1].collect()["scores"])
