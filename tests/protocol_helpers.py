"""Shared by the tests of `agent.protocol`: the default limits, a tensor built by hand, and
a request parsed or refused the full way (decode, then parse)."""

from __future__ import annotations

import struct
from typing import Any

import cbor2
import pytest
from cbor2 import CBORTag

from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload
from agent.protocol.requests import Request, parse_request
from agent.protocol.topics import ReplyTopics

LIMITS = Limits()
PREFIXES = ReplyTopics(("edge/",))


def tensor(shape: list[int], tag: int, data: bytes) -> CBORTag:
    return CBORTag(40, [shape, CBORTag(tag, data)])


GOOD_TOKEN = tensor([1, 1], 79, struct.pack("<q", 1))


def request(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "req-1", "inputs": {"token": GOOD_TOKEN}}
    body.update(fields)
    return body


def parse(body: Any, limits: Limits = LIMITS) -> Request:
    payload = decode_payload(cbor2.dumps(body), limits)
    return parse_request(payload, "decoder", limits, reply_topics=PREFIXES)


def refused(body: Any, code: str = "bad_request") -> WireError:
    with pytest.raises(WireError) as info:
        parse(body)
    assert info.value.code == code, info.value
    assert info.value.message and "\n" not in info.value.message
    return info.value


def decode_error(data: bytes, limits: Limits = LIMITS) -> WireError:
    with pytest.raises(WireError) as info:
        decode_payload(data, limits)
    return info.value
