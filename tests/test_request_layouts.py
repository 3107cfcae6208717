"""Repeats of a request's layout are parsed from its bytes (agent.protocol.layouts): whatever
that accepts, the full way (decode, parse) must accept as the same request."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import cbor2
import numpy as np
import pytest

from agent.protocol.errors import Limits, WireError
from agent.protocol.layouts import BACKOFF_AFTER, BACKOFF_EVERY, MAX_LAYOUTS, RequestLayouts
from agent.protocol.payload import ZSTD_MAGIC, decode_payload
from agent.protocol.requests import Request, parse_request
from agent.protocol.tensors import encode_tensor
from agent.protocol.topics import ReplyTopics

LIMITS = Limits()
PREFIXES = ReplyTopics(("edge/",))


def _tensor(arr: np.ndarray, tag: int | None = None) -> cbor2.CBORTag:
    if tag is None:
        return encode_tensor(arr)
    return cbor2.CBORTag(40, [list(arr.shape), cbor2.CBORTag(tag, arr.tobytes())])


def _full(payload: bytes, model: str = "m") -> Request:
    return parse_request(decode_payload(payload, LIMITS), model, LIMITS, reply_topics=PREFIXES)


def _learned(payload: bytes, model: str = "m") -> RequestLayouts:
    layouts = RequestLayouts()
    decoded = decode_payload(payload, LIMITS)
    request = parse_request(decoded, model, LIMITS, reply_topics=PREFIXES)
    layouts.learn(payload, decoded, request, LIMITS, PREFIXES)
    return layouts


def _same(a: Request, b: Request) -> None:
    for f in dataclasses.fields(Request):
        if f.name != "inputs":
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert list(a.inputs) == list(b.inputs)
    for name in a.inputs:
        x, y = a.inputs[name], b.inputs[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
        assert x.flags.writeable == y.flags.writeable, name


Body = Callable[[str, np.random.Generator], dict[str, Any]]

BODIES: dict[str, Body] = {
    "mlp, stream false": lambda i, g: {
        "id": i,
        "inputs": {"x": _tensor(g.standard_normal((1, 256)).astype(np.float32))},
        "stream": False,
    },
    "every option": lambda i, g: {
        "id": i,
        "inputs": {"token": _tensor(g.integers(0, 32, (2, 1)).astype(np.int64))},
        "version": 3,
        "stream": True,
        "priority": 7,
        "deadline_ms": 250,
        "qos": 2,
        "reply_to": "edge/backend-1/answers",
        "params": {"max_steps": 12, "note": "keep"},
    },
    "two inputs, big-endian float32 and uint8": lambda i, g: {
        "inputs": {
            "a": _tensor(g.standard_normal((3, 4)).astype(">f4"), tag=81),
            "b": _tensor(g.integers(0, 255, (5,)).astype(np.uint8)),
        },
        "id": i,  # not first
    },
    "a bare typed array (no shape tag)": lambda i, g: {
        "id": i,
        "inputs": {"v": cbor2.CBORTag(86, g.standard_normal(7).astype("<f8").tobytes())},
    },
    "a 40-character id": lambda i, g: {
        "id": i * 4,
        "inputs": {"x": _tensor(g.standard_normal((1, 16)).astype(np.float32))},
    },
}


@pytest.mark.parametrize("kind", list(BODIES))
def test_a_repeat_parses_as_the_full_way_does(kind: str) -> None:
    body, g = BODIES[kind], np.random.default_rng(7)
    layouts = _learned(cbor2.dumps(body("req-000000001", g)))
    assert len(layouts) == 1
    for n in range(2, 6):
        payload = cbor2.dumps(body(f"req-{n:09d}", g))
        fast = layouts.parse(payload, "m", LIMITS, PREFIXES)
        assert fast is not None
        _same(fast, _full(payload))
    assert layouts.hits == 4


def test_every_changed_byte_parses_the_same_or_goes_the_full_way() -> None:
    """Each byte of a repeat replaced by several values: the layout either refuses it or
    parses it exactly as the full way does; the full way never refuses what it accepts."""
    g = np.random.default_rng(3)
    body = BODIES["every option"]
    layouts = _learned(cbor2.dumps(body("req-000000001", g)))
    payload = cbor2.dumps(body("req-000000002", g))
    accepted = refused = 0
    for position in range(len(payload)):
        for value in {payload[position] ^ 0x01, payload[position] ^ 0x80, 0x00, 0x2D, 0xFF}:
            mutated = payload[:position] + bytes([value]) + payload[position + 1 :]
            fast = layouts.parse(mutated, "m", LIMITS, PREFIXES)
            if fast is None:
                refused += 1
                continue
            accepted += 1
            _same(fast, _full(mutated))  # raises if the full way refuses it
    assert accepted and refused  # the data and the id take new bytes; the rest does not


def test_random_payloads_of_the_learned_size_are_refused_or_parsed_the_same() -> None:
    rng = random.Random(11)
    g = np.random.default_rng(5)
    body = BODIES["mlp, stream false"]
    template = cbor2.dumps(body("req-000000001", g))
    layouts = _learned(template)
    for _ in range(300):
        cut = rng.randrange(len(template))
        mutated = bytearray(template)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(cut, len(template))] = rng.randrange(256)
        fast = layouts.parse(bytes(mutated), "m", LIMITS, PREFIXES)
        if fast is not None:
            _same(fast, _full(bytes(mutated)))


def test_an_id_the_pattern_refuses_goes_the_full_way() -> None:
    g = np.random.default_rng(1)
    body = BODIES["mlp, stream false"]
    layouts = _learned(cbor2.dumps(body("req-000000001", g)))
    for bad in ("req 000000002", "req/000000002", "req+000000002", "réq-00000002"):
        payload = cbor2.dumps(body(bad, g))
        assert layouts.parse(payload, "m", LIMITS, PREFIXES) is None
        with pytest.raises(WireError):
            _full(payload)


def test_another_size_model_limits_or_prefixes_go_the_full_way() -> None:
    g = np.random.default_rng(2)
    body = BODIES["mlp, stream false"]
    layouts = _learned(cbor2.dumps(body("req-000000001", g)))
    repeat = cbor2.dumps(body("req-000000002", g))
    assert layouts.parse(repeat, "m", LIMITS, PREFIXES) is not None
    assert layouts.parse(cbor2.dumps(body("req-02", g)), "m", LIMITS, PREFIXES) is None
    assert layouts.parse(repeat, "other-model", LIMITS, PREFIXES) is None
    assert layouts.parse(repeat, "m", Limits(), PREFIXES) is None  # reloaded limits
    assert layouts.parse(repeat, "m", LIMITS, ReplyTopics(("other/",))) is None
    assert layouts.parse(bytearray(repeat), "m", LIMITS, PREFIXES) is None  # type: ignore[arg-type]


def test_each_size_of_a_model_has_its_own_layout() -> None:
    """Two backends sending other batch sizes to one model do not evict each other."""
    g = np.random.default_rng(4)
    layouts = RequestLayouts()
    for rows in (1, 4):
        body = {"id": "req-000000001", "inputs": {"x": _tensor(g.random((rows, 8), np.float32))}}
        payload = cbor2.dumps(body)
        decoded = decode_payload(payload, LIMITS)
        request = parse_request(decoded, "m", LIMITS, reply_topics=PREFIXES)
        layouts.learn(payload, decoded, request, LIMITS, PREFIXES)
    for rows in (1, 4):
        body = {"id": "req-000000002", "inputs": {"x": _tensor(g.random((rows, 8), np.float32))}}
        assert layouts.parse(cbor2.dumps(body), "m", LIMITS, PREFIXES) is not None


def test_no_layout_where_a_span_is_not_in_the_payload_exactly_once() -> None:
    g = np.random.default_rng(6)
    same = g.standard_normal((1, 8)).astype(np.float32)
    twice_the_data = {"id": "req-1", "inputs": {"a": _tensor(same), "b": _tensor(same)}}
    twice_the_id = {
        "id": "req-1",
        "inputs": {"a": _tensor(same)},
        "params": {"echo": "req-1"},  # the id's bytes again
    }
    zeros = {"id": "req-1", "inputs": {"a": _tensor(np.zeros((1, 64), np.float32))}}
    for body in (twice_the_data, twice_the_id):
        assert len(_learned(cbor2.dumps(body))) == 0
    # Zeros after a length byte that is zero: found with their tag and head, exactly once.
    assert len(_learned(cbor2.dumps(zeros))) == 1


def test_a_failed_learn_forgets_the_old_layout_of_that_size() -> None:
    g = np.random.default_rng(8)
    same = g.standard_normal((1, 8)).astype(np.float32)
    layouts = _learned(cbor2.dumps({"id": "req-1", "inputs": {"a": _tensor(same)}}))
    assert len(layouts) == 1
    body = {"id": "req-1", "inputs": {"a": _tensor(same)}, "params": {"e": "req-1"}}
    payload = cbor2.dumps({"id": "req-1", "inputs": {"a": _tensor(same)}})
    decoded = decode_payload(cbor2.dumps(body), LIMITS)
    request = parse_request(decoded, "m", LIMITS, reply_topics=PREFIXES)
    layouts.learn(cbor2.dumps(body), decoded, request, LIMITS, PREFIXES)
    assert len(layouts) == 1  # another size: the first layout stays
    assert layouts.parse(payload, "m", LIMITS, PREFIXES) is not None


def test_compressed_and_large_payloads_are_not_learned() -> None:
    g = np.random.default_rng(9)
    big = {"id": "req-1", "inputs": {"x": _tensor(g.standard_normal((1, 20000)).astype("<f4"))}}
    assert len(_learned(cbor2.dumps(big))) == 0  # 80 kB
    small = cbor2.dumps({"id": "req-1", "inputs": {"x": _tensor(np.ones((1, 4), np.float32))}})
    packed = ZSTD_MAGIC + b"\0" * 8
    layouts = RequestLayouts()
    decoded = decode_payload(small, LIMITS)
    request = parse_request(decoded, "m", LIMITS, reply_topics=PREFIXES)
    layouts.learn(packed, decoded, request, LIMITS, PREFIXES)
    assert len(layouts) == 0


def test_layouts_are_bounded() -> None:
    layouts = RequestLayouts()
    for n in range(MAX_LAYOUTS + 20):
        payload = cbor2.dumps({"id": "req-1", "inputs": {"x": _tensor(np.full((1, 4), n, "<f4"))}})
        decoded = decode_payload(payload, LIMITS)
        request = parse_request(decoded, f"m{n}", LIMITS, reply_topics=PREFIXES)
        layouts.learn(payload, decoded, request, LIMITS, PREFIXES)
    assert len(layouts) == MAX_LAYOUTS


def test_learning_backs_off_where_learned_layouts_never_match() -> None:
    """A client whose requests differ in more than the id and the data (a timestamp) would
    pay for learning on every request: after a few unmatched layouts, only now and then."""
    g = np.random.default_rng(10)
    layouts = RequestLayouts()
    learned = []
    for n in range(BACKOFF_AFTER + 2 * BACKOFF_EVERY):
        body = {"id": "req-1", "inputs": {"x": _tensor(g.random((1, 4), np.float32))}}
        body["params"] = {"ts": 1_000_000 + n}  # same size, other bytes
        payload = cbor2.dumps(body)
        assert layouts.parse(payload, "m", LIMITS, PREFIXES) is None
        before = layouts._layouts.get(("m", len(payload)))
        decoded = decode_payload(payload, LIMITS)
        request = parse_request(decoded, "m", LIMITS, reply_topics=PREFIXES)
        layouts.learn(payload, decoded, request, LIMITS, PREFIXES)
        learned.append(layouts._layouts.get(("m", len(payload))) is not before)
    assert sum(learned) == BACKOFF_AFTER + 2
    # Once a layout matches, learning is back to every miss.
    body = {"id": "req-1", "inputs": {"x": _tensor(g.random((1, 4), np.float32))}}
    body["params"] = {"ts": 2_000_000}
    payload = cbor2.dumps(body)
    again = {**body, "id": "req-2", "inputs": {"x": _tensor(g.random((1, 4), np.float32))}}
    decoded = decode_payload(payload, LIMITS)
    request = parse_request(decoded, "m", LIMITS, reply_topics=PREFIXES)
    for _ in range(BACKOFF_EVERY):  # until the back-off lets one through
        layouts.learn(payload, decoded, request, LIMITS, PREFIXES)
        if layouts.parse(cbor2.dumps(again), "m", LIMITS, PREFIXES) is not None:
            break
    else:
        raise AssertionError("no layout learned within one back-off period")
    assert ("m", len(payload)) not in layouts._unmatched


def test_an_mqtt5_response_topic_must_be_the_learned_one() -> None:
    """The full way makes the response topic the reply_to of a payload without one: a
    repeat matches only with the same topic, and then has the same reply_to."""
    g = np.random.default_rng(13)
    body = BODIES["mlp, stream false"]
    topic = "edge/backend-7/replies"

    def full(payload: bytes, response_topic: str) -> tuple[dict[str, Any], Request]:
        decoded = {**decode_payload(payload, LIMITS), "reply_to": response_topic}
        return decoded, parse_request(decoded, "m", LIMITS, reply_topics=PREFIXES)

    layouts = RequestLayouts()
    first = cbor2.dumps(body("req-000000001", g))
    decoded, request = full(first, topic)
    layouts.learn(first, decoded, request, LIMITS, PREFIXES, topic)
    repeat = cbor2.dumps(body("req-000000002", g))
    fast = layouts.parse(repeat, "m", LIMITS, PREFIXES, topic)
    assert fast is not None and fast.reply_to == topic
    _same(fast, full(repeat, topic)[1])
    assert layouts.parse(repeat, "m", LIMITS, PREFIXES, "edge/backend-8/replies") is None
    assert layouts.parse(repeat, "m", LIMITS, PREFIXES) is None


def test_the_request_fields_are_those_a_layout_carries() -> None:
    """`RequestLayouts.parse` builds a Request field by field: a new field must be added there
    (and to the bodies above) before this passes again."""
    assert [f.name for f in dataclasses.fields(Request)] == [
        "id", "model", "inputs", "version", "stream", "priority", "deadline_ms", "qos",
        "reply_to", "params", "correlation_data",
    ]  # fmt: skip
