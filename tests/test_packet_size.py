"""Messages sized by the broker's packet limit: against a Mosquitto with `max_packet_size
65536` (announced in CONNACK on MQTT 5, configured as `[mqtt] max_packet_bytes` on 3.1.1), big
replies complete in parts that fit, and a message that cannot fit is quarantined, never
published, without a reconnect (decision 0023)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.client import AgentClient
from agent.client.reply import AgentError
from agent.delivery.out_message import OutMessage
from agent.delivery.packet_limit import NO_LIMIT, PacketLimit, publish_size
from agent.delivery.spool import Spool
from agent.demo import models as demo_models
from agent.demo.broker import EmbeddedBroker
from agent.mqtt.oversize import packet_bytes, too_large_error
from agent.protocol.payload import encode_payload
from tests.conftest import agent_config

LIMIT = 65536
TERMINALS = ("end", "result", "error")
WIDTH = 16  # the model's input row
TILES = 4096  # each output row: WIDTH * TILES float32 = 256 KiB, four packets' worth
BIG_CONFIG = """\
[stream]
mode = "batch"
micro_batch = 1
"""


def tile_model() -> onnx.ModelProto:
    """x [N, 16] float32 -> y [N, 65536]: a small request with a big reply."""
    repeats = numpy_helper.from_array(np.array([1, TILES], dtype=np.int64), "repeats")
    graph = helper.make_graph(
        [helper.make_node("Tile", ["x", "repeats"], ["y"])],
        "tile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", WIDTH * TILES])],
        initializer=[repeats],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", demo_models.OPSET)])
    model.ir_version = demo_models.IR_VERSION
    return model


@pytest.fixture(scope="module")
def small_broker() -> Iterator[EmbeddedBroker]:
    """A Mosquitto that drops any client sending a packet over 64 KiB."""
    with EmbeddedBroker(extra_config=[f"max_packet_size {LIMIT}"]) as b:
        yield b


@pytest.fixture(scope="module")
def big_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big-models")
    (root / "big" / "1").mkdir(parents=True)
    demo_models.save(tile_model(), root / "big" / "1" / "model.onnx")
    (root / "big" / "config.toml").write_text(BIG_CONFIG)
    return root


def direct_run(x: np.ndarray) -> np.ndarray:
    """The model's output run with ONNX Runtime directly."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        demo_models.to_bytes(tile_model()), providers=["CPUExecutionProvider"]
    )
    (y,) = session.run(["y"], {"x": x})
    return np.asarray(y)


def _inputs(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, WIDTH)).astype(np.float32)}


def _protocol_env(protocol: str) -> dict[str, str]:
    if protocol == "5":
        return {}  # announced by the broker in CONNACK
    return {"MQTT__PROTOCOL": '"3.1.1"', "MQTT__MAX_PACKET_BYTES": str(LIMIT)}


def _spool_with(path: Path, topic: str, payload: bytes) -> int:
    """A QoS 1 message written straight into the spool an agent will open (as an agent on a
    broker with a larger limit would have left it)."""
    spool = Spool(path, max_bytes=1 << 26, max_messages=100_000)
    try:
        return spool.add("old/0", topic, payload, 1, False, None)[0]
    finally:
        spool.close()


# --------------------------------------------------------------------------- the limit


def test_the_limit_is_the_smaller_of_configured_and_announced() -> None:
    limit = PacketLimit(0)
    assert limit.bytes == NO_LIMIT and not limit.limited
    assert limit.chunk_bytes(120 * 1024, "edge/d/result/m/1", 1, None) == 120 * 1024
    assert limit.announce(65536) == 65536
    limit = PacketLimit(131072)
    assert limit.announce(None) == 131072
    assert limit.announce(65536) == 65536  # a reconnect to a stricter broker
    assert limit.announce(None) == 131072
    bound = limit.chunk_bytes(256 * 1024, "edge/d/result/m/1", 1, b"c" * 100)
    assert bound == 131072 - limit.overhead("edge/d/result/m/1", 1, b"c" * 100)


def test_packet_bytes_is_the_publish_packet_as_written() -> None:
    message = OutMessage("a/b", b"x" * 200, 1)
    # 1 command byte, 2 bytes of remaining length (205 > 127), topic 2 + 3, mid 2, payload
    assert packet_bytes(message, 1, mqtt5=False) == 1 + 2 + 5 + 2 + 200
    assert packet_bytes(message, 0, mqtt5=True) == 1 + 2 + 5 + 1 + 200  # empty properties
    assert publish_size(3, 1, 0, 200) == packet_bytes(message, 1, mqtt5=False)


def test_a_too_large_chunk_is_replaced_by_a_too_large_error() -> None:
    import cbor2

    fields = {"v": 1, "id": "r1", "seq": 4, "type": "chunk", "model": "m", "version": 3}
    message = OutMessage("t", cbor2.dumps({**fields, "data": b"x" * 100}), 1, rid="r1", seq=4)
    error = too_large_error(message, 70000, LIMIT)
    assert error is not None
    decoded = cbor2.loads(error.payload)
    assert decoded["type"] == "error" and decoded["code"] == "too_large"
    assert (decoded["seq"], decoded["model"], decoded["version"]) == (4, "m", 3)
    assert error.stream is None  # never spooled: it answers for what is gone
    assert too_large_error(OutMessage("t", b"\xff", 1, rid="r1", seq=4), 1, 1) is None


# --------------------------------------------------------------------------- a real broker


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_big_replies_complete_within_the_brokers_packet_limit(
    small_broker, big_repository, make_agent, make_client, paho_kind, protocol, qos
):
    agent = make_agent(small_broker, big_repository, **_protocol_env(protocol))
    assert agent.transport.fast_path is (paho_kind == "fast")
    client = make_client(small_broker, agent, protocol)
    inputs = _inputs(3, seed=qos)
    expected = direct_run(inputs["x"])
    chunks = list(client.request("big", inputs, reply_qos=qos, timeout=20))
    got = np.concatenate([c.outputs["y"] for c in chunks])
    np.testing.assert_array_equal(got, expected)
    whole = client.request("big", inputs, reply_qos=qos, stream=False, timeout=20)
    results = list(whole)
    np.testing.assert_array_equal(np.concatenate([c.outputs["y"] for c in results]), expected)
    assert agent.reader.packet_limit.bytes == LIMIT
    assert agent.transport.reconnects == 0
    assert agent.transport.quarantined == 0


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_an_unsendable_spooled_message_is_quarantined_and_never_loops(
    small_broker, big_repository, tmp_path, start_agent, make_client, paho_kind, protocol
):
    config = agent_config(tmp_path, small_broker, big_repository, **_protocol_env(protocol))
    assert config.spool.path is not None
    topic = f"{config.root_topic}/result/big/old-too-large"
    spool_id = _spool_with(config.spool.path, topic, b"\x00" * (LIMIT + 1000))
    agent = start_agent(config)
    client = make_client(small_broker, agent, protocol)
    assert _answered(client)  # served after (or while) the old message is dropped
    assert agent.outbox.flush_acks()
    assert agent.transport.quarantined == 1
    assert agent.counters["messages_quarantined"] == 1
    assert agent.spool is not None and not agent.spool.load([spool_id])
    assert agent.transport.reconnects == 0
    agent.stop()
    again = start_agent(config)  # the same state: nothing left to loop on
    assert _answered(make_client(small_broker, again, protocol))
    assert again.transport.quarantined == 0
    assert again.transport.reconnects == 0


def test_a_part_made_for_a_larger_limit_ends_its_stream_with_too_large(
    small_broker, big_repository, make_agent, make_client, paho_kind
):
    """A stream sized before the limit shrank (here: sized by a limit of its own, none) still
    never publishes a packet the broker would drop: the part is quarantined, the stream ends
    with `too_large`, the connection stays up."""
    agent = make_agent(small_broker, big_repository)
    shared = agent.reader.packet_limit
    agent.reader.packet_limit = PacketLimit(0)  # streams made now are sized for no limit
    client = make_client(small_broker, agent)
    seen = _listening(client, f"{agent.root}/result/big/sized-before")
    with pytest.raises(AgentError) as raised:
        list(client.request("big", _inputs(2, seed=7), timeout=20, request_id="sized-before"))
    assert raised.value.code == "too_large"
    time.sleep(1.0)  # the request ran on: none of its later messages goes out
    assert [m["type"] for m in seen if m["type"] in TERMINALS] == ["error"]
    assert seen[-1]["type"] == "error"
    assert agent.transport.quarantined >= 1
    assert agent.transport.reconnects == 0
    agent.reader.packet_limit = shared
    assert _answered(client)  # the next request is served, sized right
    # The id again, once that stream ended: its own answer, not dropped as the old one's.
    again = client.request("big", _inputs(2, seed=7), timeout=20, request_id="sized-before")
    assert len(list(again)) == 2
    assert agent.transport.reconnects == 0


def test_a_stored_request_runs_again_sized_by_the_limit_its_first_connack_announces(
    small_broker, big_repository, tmp_path, start_agent, make_client
):
    """Run again after a crash, a stored request's reply is sized once the broker announced
    its Maximum Packet Size (MQTT 5), not for no limit before it: its parts all go out and
    its stream ends once, complete."""
    config = agent_config(tmp_path, small_broker, big_repository)
    assert config.spool.path is not None
    inputs = _inputs(2, seed=3)
    spool = Spool(config.spool.path, max_bytes=1 << 26, max_messages=100_000)
    try:
        payload = encode_payload({"id": "stored-1", "inputs": inputs})
        topic = f"{config.root_topic}/infer/big"
        assert spool.store_request("big/stored-1", topic, payload, 1, None, None)
    finally:
        spool.close()
    watcher = AgentClient(small_broker.host, small_broker.port, device_id=config.device_id)
    seen = _listening(watcher.connect(), f"{config.root_topic}/result/big/stored-1")
    try:
        agent = start_agent(config)
        deadline = time.monotonic() + 20
        while not any(m["type"] in TERMINALS for m in seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        watcher.close()
    assert [m["type"] for m in seen if m["type"] in TERMINALS] == ["end"]
    assert agent.transport.quarantined == 0 and agent.transport.reconnects == 0
    assert [m["seq"] for m in seen] == list(range(len(seen)))


def _listening(client: AgentClient, topic: str) -> list[dict[str, Any]]:
    """The messages `client` gets on `topic`, as they come."""
    seen: list[dict[str, Any]] = []
    client.listen(topic, lambda t, m, raw: seen.append(m or {}))
    return seen


def _answered(client: AgentClient, **options: Any) -> int:
    """A small request's chunks (each row 256 KiB: two rows, many parts)."""
    inputs = _inputs(2, seed=1)
    chunks = list(client.request("big", inputs, timeout=20, **options))
    np.testing.assert_array_equal(
        np.concatenate([c.outputs["y"] for c in chunks]), direct_run(inputs["x"])
    )
    return len(chunks)
