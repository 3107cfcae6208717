"""Requests: the request table key by key, and inputs checked against a model's."""

from __future__ import annotations

from typing import Any

import cbor2
import numpy as np
import pytest

from agent.models.backends.base import TensorSpec
from agent.protocol.errors import ID_PATTERN, WireError
from agent.protocol.payload import decode_payload
from agent.protocol.requests import parse_request, read_request_id, validate_inputs
from agent.protocol.topics import ReplyTopics
from tests.protocol_helpers import GOOD_TOKEN, LIMITS, parse, refused, request, tensor

# ----------------------------------------------------------------------------- requests


def test_a_full_request() -> None:
    req = parse(
        request(
            version=2,
            stream=False,
            priority=9,
            deadline_ms=250,
            qos=2,
            reply_to="edge/replies/me",
            params={"max_steps": 4, "nested": {"a": [1, 2]}},
        )
    )
    assert req.id == "req-1" and req.model == "decoder"
    assert req.inputs["token"].tolist() == [[1]] and req.inputs["token"].dtype == np.int64
    assert (req.version, req.stream, req.priority) == (2, False, 9)
    assert (req.deadline_ms, req.qos, req.reply_to) == (250, 2, "edge/replies/me")
    assert req.params == {"max_steps": 4, "nested": {"a": [1, 2]}}
    assert req.correlation_data is None


def test_request_defaults() -> None:
    req = parse(request())
    assert (req.version, req.stream, req.priority, req.deadline_ms) == (None, True, 4, None)
    assert (req.qos, req.reply_to, req.params) == (None, None, {})
    assert parse(request(priority=0, deadline_ms=0, qos=0)).priority == 0


@pytest.mark.parametrize("bad_id", ["", "x" * 65, "has space", "abc\n", "slash/id", "plus+", "é"])
def test_bad_ids(bad_id: str) -> None:
    error = refused(request(id=bad_id))
    assert error.request_id is None
    assert read_request_id({"id": bad_id}) is None


@pytest.mark.parametrize("bad_id", [17, None, True, b"abc", ["a"]])
def test_ids_that_are_not_text(bad_id: Any) -> None:
    assert refused(request(id=bad_id)).request_id is None
    body = request()
    del body["id"]
    assert refused(body).request_id is None


def test_read_request_id() -> None:
    for good in ("a", "x" * 64, "A.b_c-9", "0"):
        assert read_request_id({"id": good}) == good
        assert ID_PATTERN.match(good)
    assert read_request_id({}) is None
    assert read_request_id({"id": "abc\n"}) is None
    assert ID_PATTERN.match("abc\n") is None
    assert read_request_id([("id", "x")]) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("priority", [10, -1, True, False, "4", 4.5, 4.0, None])
def test_bad_priority(priority: Any) -> None:
    error = refused(request(priority=priority))
    assert error.request_id == "req-1" and "priority" in error.message


@pytest.mark.parametrize(
    "reply_to",
    ["other/topic", "edge/#", "edge/+/x", "edge/a\0b", "/abs", "", "edge/" + "x" * 300, 5, None],
)
def test_bad_reply_to(reply_to: Any) -> None:
    if reply_to is None:
        assert parse(request(reply_to=None)).reply_to is None
        return
    error = refused(request(reply_to=reply_to))
    assert error.request_id == "req-1" and "reply_to" in error.message


def test_reply_to_prefixes() -> None:
    payload = decode_payload(cbor2.dumps(request(reply_to="apps/x/replies")), LIMITS)
    req = parse_request(payload, "m", LIMITS, reply_topics=ReplyTopics(("edge/", "apps/x/")))
    assert req.reply_to == "apps/x/replies"
    with pytest.raises(WireError):
        parse_request(payload, "m", LIMITS, reply_topics=ReplyTopics(()))


def test_unknown_key_is_named() -> None:
    error = refused(request(unexpected=1))
    assert "'unexpected'" in error.message and error.request_id == "req-1"
    assert "'v'" in refused(request(v=1)).message


@pytest.mark.parametrize(
    "fields",
    [
        {"version": 0},
        {"version": -1},
        {"version": True},
        {"version": "1"},
        {"stream": "yes"},
        {"stream": 1},
        {"qos": 3},
        {"qos": True},
        {"qos": 1.0},
        {"deadline_ms": -5},
        {"deadline_ms": 1.5},
        {"deadline_ms": False},
        {"params": [1]},
        {"params": {1: 2}},
        {"inputs": [GOOD_TOKEN]},
        {"inputs": {"token": 1}},
        {"inputs": {"": GOOD_TOKEN}},
        {"inputs": {1: GOOD_TOKEN}},
        {"inputs": {"token": tensor([1, 3], 79, b"\0" * 8)}},
    ],
)
def test_wrong_types_of_known_keys(fields: dict[str, Any]) -> None:
    assert refused(request(**fields)).request_id == "req-1"


def test_an_integer_past_64_bits_is_named_as_the_integer_it_is() -> None:
    """CBOR carries 2**64 as a bignum (tag 2): the message shows the number, not the tag."""
    big = cbor2.loads(cbor2.dumps(2**64))
    error = refused(request(version=big))
    assert "got 18446744073709551616" in error.message and "CBORTag" not in error.message


def test_inputs_are_required_and_bounded() -> None:
    body = request()
    del body["inputs"]
    assert "inputs" in refused(body).message
    many = {f"in{j}": GOOD_TOKEN for j in range(33)}
    error = refused(request(inputs=many))
    assert "33 inputs" in error.message
    assert len(parse(request(inputs=dict(list(many.items())[:32]))).inputs) == 32
    assert parse(request(inputs={})).inputs == {}


def test_tensor_errors_carry_the_id() -> None:
    error = refused(request(inputs={"token": tensor([2], 79, b"\0" * 8)}))
    assert error.request_id == "req-1" and "'token'" in error.message


# ----------------------------------------------------------------------------- validate_inputs

SPECS = [
    TensorSpec("ids", np.dtype(np.int64), ("batch", 4)),
    TensorSpec("mask", np.dtype(np.bool_), (None, 4)),
    TensorSpec("scale", np.dtype(np.float32), ()),
]


def good_inputs() -> dict[str, np.ndarray]:
    return {
        "scale": np.array(0.5, dtype=np.float32),
        "mask": np.array([[1, 0, 1, 1]], dtype=np.uint8),
        "ids": np.zeros((1, 4), dtype=np.int64),
    }


def invalid(inputs: dict[str, Any], specs: list[TensorSpec] = SPECS) -> str:
    with pytest.raises(WireError) as info:
        validate_inputs("r-1", inputs, specs)
    assert info.value.code == "bad_request" and info.value.request_id == "r-1"
    return info.value.message


def test_validate_inputs_in_spec_order() -> None:
    checked = validate_inputs("r-1", good_inputs(), SPECS)
    assert list(checked) == ["ids", "mask", "scale"]
    assert checked["mask"].dtype == np.bool_
    assert checked["mask"].tolist() == [[True, False, True, True]]
    bigger = good_inputs() | {"ids": np.zeros((7, 4), np.int64), "mask": np.ones((3, 4), bool)}
    assert validate_inputs("r-1", bigger, SPECS)["ids"].shape == (7, 4)


def test_validate_inputs_refusals() -> None:
    inputs = good_inputs()
    del inputs["mask"]
    assert "missing input(s) 'mask'" in invalid(inputs)
    assert "unexpected input(s) 'extra'" in invalid(good_inputs() | {"extra": np.zeros(1)})
    message = invalid(good_inputs() | {"ids": np.zeros((1, 4), dtype=np.float32)})
    assert "float32" in message and "expected int64" in message
    assert "rank 1" in invalid(good_inputs() | {"ids": np.zeros(4, dtype=np.int64)})
    message = invalid(good_inputs() | {"ids": np.zeros((1, 5), dtype=np.int64)})
    assert "axis 1" in message and "expected 4" in message
    assert "0 or 1" in invalid(good_inputs() | {"mask": np.full((1, 4), 2, dtype=np.uint8)})
    assert "not a tensor" in invalid(good_inputs() | {"ids": [[0, 0, 0, 0]]})
    # No implicit casts, even lossless ones.
    assert "int32" in invalid(good_inputs() | {"ids": np.zeros((1, 4), dtype=np.int32)})
