"""The payload guard: sizes, zstd frames, the header walk, cbor2 options; and a fuzz of
decoding and parsing together."""

from __future__ import annotations

import random
import time
from typing import Any

import cbor2
import numpy as np
import pytest
import zstandard
from cbor2 import CBORTag

from agent.protocol import payload as payload_module
from agent.protocol.cbor_scan import scan_map
from agent.protocol.errors import ERROR_CODES, ID_PATTERN, Limits, WireError
from agent.protocol.payload import ZSTD_MAGIC, decode_payload, encode_payload
from agent.protocol.requests import parse_request
from tests.protocol_helpers import (
    GOOD_TOKEN,
    LIMITS,
    PREFIXES,
    decode_error,
    request,
    tensor,
)

# ----------------------------------------------------------------------------- payloads


def test_payload_accepts_bytes_bytearray_and_memoryview() -> None:
    data = cbor2.dumps({"a": 1})
    for form in (data, bytearray(data), memoryview(data)):
        assert decode_payload(form, LIMITS) == {"a": 1}


def test_zstd_payloads() -> None:
    body = {"id": "z-1", "inputs": {"t": np.zeros((64, 64), dtype=np.float32)}}
    plain = encode_payload(body)
    packed = encode_payload(body, compress_over=1024)
    assert packed[:4] == ZSTD_MAGIC and len(packed) < len(plain)
    assert zstandard.frame_content_size(packed) == len(plain)  # receivers can check it first
    assert decode_payload(packed, LIMITS) == decode_payload(plain, LIMITS)
    # Under the threshold, or when compression saves nothing: plain CBOR.
    assert encode_payload(body, compress_over=len(plain)) == plain
    noise = np.random.default_rng(1).bytes(4096)
    assert encode_payload({"n": noise}, compress_over=100)[:4] != ZSTD_MAGIC
    # A frame without a content size decodes too.
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(plain)
    assert zstandard.frame_content_size(unsized) == -1
    assert decode_payload(unsized, LIMITS)["id"] == "z-1"


def _zeros_frame(total: int, *, declare: bool) -> bytes:
    """A zstd frame of ``total`` zero bytes, built chunk by chunk (never held whole)."""
    cobj = zstandard.ZstdCompressor().compressobj(size=total if declare else -1)
    chunk = bytes(1 << 20)
    out = [cobj.compress(chunk) for _ in range(total >> 20)]
    return b"".join(out) + cobj.flush()


@pytest.mark.parametrize("declare", [True, False])
def test_zstd_bomb_is_too_large(declare: bool) -> None:
    bomb = _zeros_frame(256 << 20, declare=declare)
    assert len(bomb) < 64 * 1024
    assert (zstandard.frame_content_size(bomb) == 256 << 20) is declare
    started = time.perf_counter()
    error = decode_error(bomb)
    assert error.code == "too_large", error
    assert time.perf_counter() - started < 0.5  # capped at the limit, not decompressed in full


def test_zstd_frame_just_under_the_cap_and_over_it() -> None:
    data = cbor2.dumps({"b": bytes(5000)})
    limits = Limits(max_decompressed_bytes=len(data))
    for sized in (True, False):
        frame = zstandard.ZstdCompressor(write_content_size=sized).compress(data)
        assert decode_payload(frame, limits) == {"b": bytes(5000)}
        small = Limits(max_decompressed_bytes=len(data) - 1)
        assert decode_error(frame, small).code == "too_large"


def test_bad_zstd_frames() -> None:
    frame = zstandard.ZstdCompressor().compress(cbor2.dumps({"a": 1}))
    for data in (ZSTD_MAGIC, frame[:-2], frame + b"\0", frame[:6] + b"\xff" * 20):
        assert decode_error(data).code == "bad_request"
    # The decompressed bytes must be a CBOR map too (no zstd inside zstd).
    nested = zstandard.ZstdCompressor().compress(frame)
    assert decode_error(nested).code == "bad_request"


def test_payload_over_the_size_limit() -> None:
    limits = Limits(max_payload_bytes=4096)
    body = {"id": "big-1", "inputs": {"t": np.ones((1, 4000), dtype=np.int64)}}
    error = decode_error(encode_payload(body), limits)
    assert error.code == "too_large"
    assert error.request_id == "big-1"  # read from the first bytes only, to answer it
    # The look for the id is bounded (64 items), not a decode: an id after that is not seen.
    later = {"inputs": {"t": np.ones((1, 4000), dtype=np.int64)}, "id": "late-1"}
    assert decode_error(encode_payload(later), limits).request_id == "late-1"
    latest = {"params": {"p": list(range(100))}, "inputs": later["inputs"], "id": "late-2"}
    error = decode_error(encode_payload(latest), limits)
    assert error.code == "too_large" and error.request_id is None
    # The limit is on the raw bytes, whatever they hold; at the limit is still decoded.
    assert decode_error(b"\xff" * 4097, limits).code == "too_large"
    at_limit = cbor2.dumps({"b": bytes(4096 - 6)})
    assert len(at_limit) == 4096 and decode_payload(at_limit, limits)
    # zstd frame that declares more than allowed: the id is read from its first bytes.
    frame = encode_payload(body, compress_over=0)
    error = decode_error(frame, Limits(max_decompressed_bytes=4096))
    assert error.code == "too_large" and error.request_id == "big-1"


def test_random_bytes() -> None:
    rng = random.Random(3)
    for _ in range(200):
        data = bytes([0xFF]) + rng.randbytes(rng.randint(0, 300))
        assert decode_error(data).code == "bad_request"
    assert decode_error(b"").code == "bad_request"


@pytest.mark.parametrize("obj", [[1, 2, 3], "text", 42, b"bytes", None, 3.5, CBORTag(1, 0)])
def test_cbor_that_is_not_a_map(obj: Any) -> None:
    error = decode_error(cbor2.dumps(obj))
    assert error.code == "bad_request" and error.request_id is None


def test_top_level_keys_must_be_text() -> None:
    error = decode_error(cbor2.dumps({"id": "k-1", 1: 2}))
    assert error.code == "bad_request" and error.request_id == "k-1"


def test_deep_nesting() -> None:
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    error = decode_error(cbor2.dumps({"id": "deep-1", "params": {"x": deep}}))
    assert error.code == "bad_request" and error.request_id == "deep-1"
    assert "nesting" in error.message


@pytest.mark.parametrize("levels", range(1, 12))
def test_depth_limit_matches_cbor2(levels: int) -> None:
    """The scan and cbor2 count depth alike: containers (and tags) around an item."""
    value: object = 1
    for i in range(levels):
        value = [value] if i % 3 else CBORTag(99, value) if i % 2 else {"k": value}
    data = cbor2.dumps({"v": value})
    try:
        cbor2.loads(data, max_depth=LIMITS.max_depth)
        cbor2_ok = True
    except cbor2.CBORDecodeError:
        cbor2_ok = False
    try:
        decode_payload(data, LIMITS)
        ours = True
    except WireError:
        ours = False
    assert ours == cbor2_ok == (levels + 1 <= LIMITS.max_depth)


def test_too_many_keys() -> None:
    keys = {f"k{j}": GOOD_TOKEN for j in range(100)}
    error = decode_error(cbor2.dumps({"id": "keys-1", "inputs": keys}))
    assert error.code == "bad_request" and error.request_id == "keys-1"
    assert decode_error(cbor2.dumps({f"k{j}": 1 for j in range(65)})).code == "bad_request"
    assert len(decode_payload(cbor2.dumps({f"k{j}": 1 for j in range(64)}), LIMITS)) == 64
    # The same through an indefinite-length map.
    indefinite = b"\xa1\x66params\xbf" + b"".join(cbor2.dumps(f"p{j}") + b"\x01" for j in range(65))
    assert decode_error(indefinite + b"\xff").code == "bad_request"


def test_too_many_items() -> None:
    error = decode_error(cbor2.dumps({"id": "items-1", "params": {"x": [0] * 70000}}))
    assert error.code == "bad_request" and error.request_id == "items-1"
    # Empty arrays are one byte each: without the item bound, 16 MB would be 16 M lists.
    packed = zstandard.ZstdCompressor().compress(
        b"\xa1\x61x\x9a\x00\x10\x00\x00" + b"\x80" * (1 << 20)
    )
    assert decode_error(packed).code == "bad_request"
    chunks = b"\xa1\x61x\x5f" + b"\x40" * 70000 + b"\xff"  # empty chunks of a byte string
    assert decode_error(chunks).code == "bad_request"


def test_truncated_and_trailing_bytes() -> None:
    data = cbor2.dumps({"id": "trunc-1", "inputs": {"token": GOOD_TOKEN}})
    for cut in (1, 3, 10):
        error = decode_error(data[:-cut])
        assert error.code == "bad_request" and error.request_id == "trunc-1"
    late = cbor2.dumps({"inputs": {"token": GOOD_TOKEN}, "id": "late-1"})
    assert decode_error(late[:-3]).request_id is None
    assert decode_error(data + b"\x00").code == "bad_request"
    assert decode_error(data + data).code == "bad_request"


def _walk_then_decode(data: bytes) -> Any:
    """The path for payloads over DECODE_FIRST_BYTES: the header walk, then cbor2."""
    buf = memoryview(data)
    scan_map(
        buf,
        max_depth=LIMITS.max_depth,
        max_map_keys=LIMITS.max_map_keys,
        max_items=LIMITS.max_items,
    )
    return cbor2.loads(buf, max_depth=LIMITS.max_depth, **payload_module._LOADS_OPTIONS)


def test_small_payloads_decoded_first_accept_nothing_the_walk_refuses() -> None:
    """Small payloads are decoded before their limits are checked; whatever that path accepts,
    the walk accepts too and decodes to the same map (mutated requests, nested tags, keys that
    are maps or arrays, refused tags, too many keys, trailing bytes)."""
    rng = random.Random(11)
    seeds = [
        cbor2.dumps(request()),
        cbor2.dumps({"id": "t-1", "params": {"a": [1, 2.5, None, True], "b": {"c": b"x"}}}),
        cbor2.dumps({"id": "t-2", "v": CBORTag(99, [CBORTag(28, 1)])}),
        b"\xa2\x61a\x01\xa1\x82\x01\x02\x01" + b"",  # a map whose key is an array
        b"\xa1\xa1\x61k\xd8\x19\x00\x01",  # a map key holding a refused tag
        cbor2.dumps({f"k{j}": 1 for j in range(65)}),
        cbor2.dumps({"id": "t-3"}) + b"\xff",
        b"\xbf\x62id\x63t-4\x61l\x9f\x01\xff\xff",
    ]
    accepted = 0
    for seed in seeds:
        for trial in range(400):
            data = bytearray(seed)
            if trial:
                for _ in range(rng.randint(1, 3)):
                    pos = rng.randrange(len(data))
                    op = rng.random()
                    if op < 0.6:
                        data[pos] = rng.randrange(256)
                    elif op < 0.8:
                        del data[pos]
                    else:
                        data.insert(pos, rng.randrange(256))
            small = payload_module._decode_small(memoryview(bytes(data)), LIMITS)
            if small is None:
                continue
            accepted += 1
            assert _walk_then_decode(bytes(data)) == small, bytes(data)
    assert accepted > 100  # the valid seeds unmutated, and mutations that stay valid


def test_duplicate_keys_are_refused() -> None:
    data = b"\xa2\x62id\x63one\x62id\x63two"
    error = decode_error(data)
    assert error.code == "bad_request" and error.request_id == "one"


def test_malformed_cbor() -> None:
    cases = [
        b"\xa1\x61a\x1c",  # reserved additional information
        b"\xa1\x61a\xff",  # break outside an indefinite item
        b"\xa1\x61a\xf8\x01",  # two-byte simple value below 32
        b"\xa1\x61a\x5f\x61x\xff",  # text chunk in a byte string
        b"\xbf\x61a\xff",  # indefinite map ending after a key
        b"\xa1\x61a\x62\xff\xfe",  # invalid UTF-8
        b"\xa1\x61a\x9b\x00\x00\x00\x01\x00\x00\x00\x00",  # 2^32 items declared
        b"\xa1\x61a\x5b\xff\xff\xff\xff\xff\xff\xff\xff",  # 2^64 - 1 bytes declared
    ]
    for data in cases:
        error = decode_error(data)
        assert error.code == "bad_request", data


def test_indefinite_lengths_are_well_formed_cbor() -> None:
    data = b"\xbf\x62id\x7f\x62ab\x61c\xff\x61l\x9f\x01\x5f\x41x\xff\xff\xff"
    assert decode_payload(data, LIMITS) == {"id": "abc", "l": [1, b"x"]}


def test_self_described_cbor_prefix() -> None:
    data = b"\xd9\xd9\xf7" + cbor2.dumps({"a": 1})
    assert decode_payload(data, LIMITS) == {"a": 1}


def test_tags_stay_cbor_tags() -> None:
    """cbor2 6 decodes tags such as 0, 1, 2, 35 or 258 itself; here every tag stays raw."""
    values: dict[int, Any] = {
        0: "2024-01-01T00:00:00Z",
        1: 5,
        2: b"\x01\x00",
        3: b"\x01",
        4: [-1, 15],
        5: [-1, 3],
        30: [1, 3],
        35: "a+",
        36: "Content-Type: text/plain\n\nhi",
        37: b"\0" * 16,
        52: b"\x7f\0\0\x01",
        54: b"\0" * 16,
        100: 1,
        258: [1, 2],
        260: b"\x7f\0\0\x01",
        261: {b"\x7f\0\0\x01": 8},
        1004: "2024-01-01",
        43000: b"\0",
        55799: 1,
        40: [1],
        64: 1,
        999: 1,
        1 << 40: "x",
    }
    rng = random.Random(5)
    values.update({t: 1 for t in rng.sample(range(6, 70000), 200)})
    params = {f"t{tag}": CBORTag(tag, value) for tag, value in values.items() if tag != 25}
    for start in range(0, len(params), 60):
        chunk = dict(list(params.items())[start : start + 60])
        decoded = decode_payload(cbor2.dumps({"params": chunk}), LIMITS)["params"]
        for key, tag_value in chunk.items():
            assert isinstance(decoded[key], CBORTag), (key, decoded[key])
            assert decoded[key].tag == tag_value.tag


def test_cbor2_decodes_no_tag_the_agent_does_not_keep_raw() -> None:
    """The agent gives cbor2 a keep-it-raw decoder only for the tags cbor2 decodes itself;
    every other tag stays a CBORTag because cbor2 has no decoder for it. A cbor2 release that
    gains one must fail here (the tag then joins agent.protocol.payload._BUILTIN_TAGS)."""
    tags = [*range(70_000), 1 << 16 | 5, 1 << 20, 1 << 31, (1 << 32) + 1, 1 << 63, (1 << 64) - 1]
    native = [tag for tag in tags if payload_module._decoded_natively(tag)]
    assert set(native) <= set(payload_module._RAW_TAGS)
    # The list is the real one, not a superset.
    assert set(native) == set(payload_module._BUILTIN_TAGS)


@pytest.mark.parametrize("tag", [25, 28, 29, 256])
def test_value_sharing_tags_are_refused(tag: int) -> None:
    # 28 over [29(0)] would be a list that contains itself.
    data = cbor2.dumps({"id": "share-1", "x": CBORTag(tag, [CBORTag(29, 0)])})
    error = decode_error(data)
    assert error.code == "bad_request" and error.request_id == "share-1"


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.35 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif choice < 0.5 and buf:
            del buf[rng.randrange(len(buf)) :]
        elif choice < 0.65:
            at = rng.randrange(len(buf) + 1)
            buf[at:at] = rng.randbytes(rng.randint(1, 8))
        elif choice < 0.8 and len(buf) > 2:
            start = rng.randrange(len(buf) - 1)
            end = rng.randrange(start + 1, len(buf))
            buf[start:end] = buf[start:end] * rng.randint(2, 4)
        elif buf:
            at = rng.randrange(len(buf))
            buf[at] = rng.choice([0x9F, 0xBF, 0x5F, 0x7F, 0xFF, 0xD8, 0x1B, 0xFB, 0xF8, 0xA0])
    return bytes(buf)


def test_fuzz_only_wire_errors() -> None:
    """2000 random and mutated payloads: each decodes and parses, or raises WireError."""
    rng = random.Random(20240611)
    seeds = [
        cbor2.dumps(request()),
        encode_payload(
            {
                "id": "fuzz-1",
                "inputs": {
                    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
                    "b": np.array([True, False]),
                    "c": np.arange(3, dtype=">i2"),
                },
                "priority": 3,
                "params": {"max_steps": 8, "list": [1, "two", 3.0, None, b"x"]},
                "reply_to": "edge/x",
            }
        ),
        cbor2.dumps(request(inputs={"t": tensor([2, 2], 74, b"\0" * 16)}, qos=1, version=3)),
        b"\xbf\x62id\x61x\x66inputs\xbf\x61t\xd8\x28\x82\x81\x02\xd8\x40\x42\x01\x02\xff\xff",
    ]
    seeds.append(zstandard.ZstdCompressor().compress(seeds[1]))
    outcomes = {"ok": 0, "error": 0}
    for i in range(2000):
        if i % 10 == 0:
            data = rng.randbytes(rng.randint(0, 64))
        elif i % 10 == 1:
            data = zstandard.ZstdCompressor().compress(_mutate(rng, rng.choice(seeds[:4])))
        else:
            data = _mutate(rng, rng.choice(seeds))
        try:
            payload = decode_payload(data, LIMITS)
            req = parse_request(payload, "m", LIMITS, reply_topics=PREFIXES)
            for arr in req.inputs.values():
                assert arr.nbytes <= LIMITS.max_tensor_bytes
            outcomes["ok"] += 1
        except WireError as e:
            assert e.code in ERROR_CODES and e.message
            assert e.request_id is None or ID_PATTERN.match(e.request_id)
            outcomes["error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > 1000
