"""The one reader of a request (agent.service.ingress.RequestReader): bytes in, an admitted job
or a rejection that already holds its addressed error reply, from real payloads and a real
model repository (no broker needed: nothing is sent)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cbor2
import numpy as np
import pytest

from agent.config import load_config
from agent.models.backends.base import BackendOptions
from agent.models.manager import ModelManager
from agent.mqtt.messages import Incoming
from agent.protocol.payload import decode_payload, encode_payload
from agent.protocol.tensors import encode_tensor
from agent.service.ingress import Admission, Rejection, RequestReader
from tests.conftest import write_repository

ROOT = "edge/box-1"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelManager]:
    repository = write_repository(tmp_path_factory.mktemp("models"))
    manager = ModelManager(repository, BackendOptions(intra_op_threads=1), settle_s=0.0)
    manager.sync()
    yield manager
    manager.close()


@pytest.fixture
def reader(tmp_path: Path, models: ModelManager) -> RequestReader:
    environ = {
        "EDGE_AGENT__DEVICE_ID": "box-1",
        "EDGE_AGENT__MQTT__TOPIC_PREFIX": "edge",
        "EDGE_AGENT__STATE_DIR": str(tmp_path / "state"),
        "EDGE_AGENT__MQTT__PROTOCOL": '"5"',
    }
    return RequestReader(load_config(None, environ), models)


def _incoming(payload: dict[str, object] | bytes, **kw: object) -> Incoming:
    data = payload if isinstance(payload, bytes) else encode_payload(payload)
    return Incoming(f"{ROOT}/infer/mlp", data, 1, **kw)  # type: ignore[arg-type]


def _rows(n: int) -> np.ndarray:
    return np.zeros((n, 16), np.float32)


def test_a_good_request_is_admitted_with_its_inputs_checked(reader: RequestReader) -> None:
    outcome = reader.read("mlp", _incoming({"id": "r1", "inputs": {"x": _rows(2)}}), accepting=True)
    assert isinstance(outcome, Admission)
    job = outcome.job
    assert job.request.id == "r1" and job.reply.topic == f"{ROOT}/result/mlp/r1"
    assert job.checked is not None and job.checked[0] == outcome.serving.version


def test_a_bad_request_is_refused_with_its_reply_addressed(reader: RequestReader) -> None:
    payload = {
        "id": "r2",
        "inputs": {"x": np.zeros((2, 3), np.float32)},  # the model takes 16 features
        "reply_to": "edge/box-1/result/mine",
        "qos": 0,
    }
    outcome = reader.read("mlp", _incoming(payload, correlation_data=b"c1"), accepting=True)
    assert isinstance(outcome, Rejection) and outcome.code == "bad_request"
    reply = outcome.reply
    assert reply is not None
    assert (reply.request_id, reply.topic, reply.qos, reply.correlation) == (
        "r2",
        "edge/box-1/result/mine",
        0,
        b"c1",
    )
    reply.error(outcome.code, outcome.message)
    (message,) = reply.drain()
    body = decode_payload(message.payload, reader.limits)
    assert (body["type"], body["code"], body["id"]) == ("error", "bad_request", "r2")


def test_a_reply_topic_outside_the_allowed_prefixes_is_not_used(reader: RequestReader) -> None:
    payload = {"id": "r3", "inputs": {"x": _rows(1)}, "reply_to": "elsewhere/x"}
    outcome = reader.read("mlp", _incoming(payload), accepting=True)
    assert isinstance(outcome, Rejection) and outcome.reply is not None
    assert outcome.reply.topic == f"{ROOT}/result/mlp/r3"


def test_input_without_a_readable_id_has_no_reply(reader: RequestReader) -> None:
    outcome = reader.read("mlp", _incoming(b"\xff\x00 not cbor"), accepting=True)
    assert isinstance(outcome, Rejection) and outcome.reply is None


def test_an_unknown_model_and_a_stopping_agent_are_refused(reader: RequestReader) -> None:
    unknown = reader.read(
        "nope", _incoming({"id": "r4", "inputs": {"x": _rows(1)}}), accepting=True
    )
    assert isinstance(unknown, Rejection) and unknown.code == "unknown_model"
    assert unknown.reply is not None and unknown.reply.topic == f"{ROOT}/result/nope/r4"
    stopping = reader.read(
        "mlp", _incoming({"id": "r5", "inputs": {"x": _rows(1)}}), accepting=False
    )
    assert isinstance(stopping, Rejection) and stopping.code == "shutting_down"


def test_a_repeated_layout_is_read_without_decoding(reader: RequestReader) -> None:
    def payload(request_id: str, value: float) -> bytes:
        tensor = encode_tensor(np.full((1, 16), value, np.float32))
        return cbor2.dumps({"id": request_id, "inputs": {"x": tensor}})

    first = reader.read("mlp", _incoming(payload("a1", 1.0)), accepting=True)
    assert isinstance(first, Admission)
    hits = reader.layouts.hits
    again = reader.read("mlp", _incoming(payload("a2", 2.0)), accepting=True)
    assert isinstance(again, Admission) and reader.layouts.hits == hits + 1
    assert again.job.request.id == "a2"
    assert float(again.job.request.inputs["x"][0, 0]) == 2.0
