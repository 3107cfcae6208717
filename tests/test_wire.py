"""The wire format: CBOR payloads, RFC 8746 tensors, request checks, reply parts."""

from __future__ import annotations

import random
import struct
import time
from typing import Any

import cbor2
import numpy as np
import pytest
import zstandard
from cbor2 import CBORTag

from agent.models.backends.base import TensorSpec
from agent.protocol import wire

LIMITS = wire.Limits()
PREFIXES = ("edge/",)


def tensor(shape: list[int], tag: int, data: bytes) -> CBORTag:
    return CBORTag(40, [shape, CBORTag(tag, data)])


GOOD_TOKEN = tensor([1, 1], 79, struct.pack("<q", 1))


def request(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "req-1", "inputs": {"token": GOOD_TOKEN}}
    body.update(fields)
    return body


def parse(body: Any, limits: wire.Limits = LIMITS) -> wire.Request:
    payload = wire.decode_payload(cbor2.dumps(body), limits)
    return wire.parse_request(payload, "decoder", limits, allowed_reply_prefixes=PREFIXES)


def refused(body: Any, code: str = "bad_request") -> wire.WireError:
    with pytest.raises(wire.WireError) as info:
        parse(body)
    assert info.value.code == code, info.value
    assert info.value.message and "\n" not in info.value.message
    return info.value


def decode_error(data: bytes, limits: wire.Limits = LIMITS) -> wire.WireError:
    with pytest.raises(wire.WireError) as info:
        wire.decode_payload(data, limits)
    return info.value


# ----------------------------------------------------------------------------- tensors

EMITTED = [
    ("uint8", 64),
    ("int8", 72),
    ("int16", 77),
    ("int32", 78),
    ("int64", 79),
    ("float16", 84),
    ("float32", 85),
    ("float64", 86),
    ("uint16", 69),
    ("uint32", 70),
    ("uint64", 71),
]


@pytest.mark.parametrize(("dtype", "tag"), EMITTED)
def test_round_trip_of_every_emitted_dtype(dtype: str, tag: int) -> None:
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else np.finfo(dtype)
    arr = np.array([[0, 1, 2], [3, info.max, info.min]], dtype=dtype)
    encoded = wire.encode_tensor(arr)
    assert encoded.tag == 40
    assert list(encoded.value[0]) == [2, 3]
    assert encoded.value[1].tag == tag
    payload = wire.decode_payload(wire.encode_payload({"t": arr}), LIMITS)
    back = wire.decode_tensor(payload["t"], LIMITS)
    assert back.dtype == np.dtype(dtype)
    assert back.shape == (2, 3)
    np.testing.assert_array_equal(back, arr)


def test_bool_travels_as_uint8() -> None:
    arr = np.array([[True, False], [False, True]])
    encoded = wire.encode_tensor(arr)
    assert encoded.value[1].tag == 64
    assert encoded.value[1].value == b"\x01\x00\x00\x01"
    back = wire.decode_tensor(cbor2.loads(cbor2.dumps(encoded)), LIMITS)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back.view(bool), arr)


def test_scalar_and_empty_tensors() -> None:
    for arr in (np.array(3.5, dtype=np.float32), np.zeros((0, 4), dtype=np.int32)):
        back = wire.decode_tensor(cbor2.loads(cbor2.dumps(wire.encode_tensor(arr))), LIMITS)
        assert back.shape == arr.shape and back.dtype == arr.dtype
        np.testing.assert_array_equal(back, arr)


# Every tag of RFC 8746 §2.1 that carries a numpy dtype, with that dtype's explicit byte order.
ACCEPTED = {
    64: "u1",
    65: ">u2",
    66: ">u4",
    67: ">u8",
    68: "u1",
    69: "<u2",
    70: "<u4",
    71: "<u8",
    72: "i1",
    73: ">i2",
    74: ">i4",
    75: ">i8",
    77: "<i2",
    78: "<i4",
    79: "<i8",
    80: ">f2",
    81: ">f4",
    82: ">f8",
    84: "<f2",
    85: "<f4",
    86: "<f8",
}


@pytest.mark.parametrize("tag", sorted(ACCEPTED))
def test_decoding_of_every_accepted_tag(tag: int) -> None:
    wire_dtype = np.dtype(ACCEPTED[tag])
    values = np.array([[1, 2, 3], [4, 5, 127]], dtype=wire_dtype)
    data = values.tobytes()  # in the tag's own byte order
    body = {"t": tensor([2, 3], tag, data), "flat": CBORTag(tag, data)}
    payload = wire.decode_payload(cbor2.dumps(body), LIMITS)
    for key, shape in (("t", (2, 3)), ("flat", (6,))):
        arr = wire.decode_tensor(payload[key], LIMITS, name=key)
        assert arr.shape == shape
        assert arr.dtype == wire_dtype.newbyteorder("=")
        assert arr.dtype.isnative
        np.testing.assert_array_equal(arr.reshape(2, 3), values.astype(arr.dtype))


def test_big_endian_bytes_are_converted() -> None:
    arr = wire.decode_tensor(tensor([2], 74, b"\x00\x00\x01\x00\xff\xff\xff\xfe"), LIMITS)
    assert arr.tolist() == [256, -2]
    arr = wire.decode_tensor(tensor([1], 82, struct.pack(">d", 1.25)), LIMITS)
    assert arr.tolist() == [1.25]


@pytest.mark.parametrize("tag", [76, 83, 87])
def test_reserved_and_float128_tags_are_refused(tag: int) -> None:
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(tensor([1], tag, b"\0" * 16), LIMITS, name="x")
    assert info.value.code == "bad_request"
    assert str(tag) in info.value.message


def test_little_endian_decode_is_zero_copy() -> None:
    raw = np.arange(12, dtype="<f4").tobytes()
    tag = CBORTag(85, raw)
    arr = wire.decode_tensor(CBORTag(40, [(3, 4), tag]), LIMITS)
    assert not arr.flags.writeable  # a view of the decoded bytes, not a copy
    assert np.shares_memory(arr, np.frombuffer(raw, dtype=np.uint8))


def test_non_contiguous_and_big_endian_arrays_encode() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    cases = [
        base[:, ::2],
        base.T,
        base[1:3, 1:5],
        base.astype(">i4"),
        base.astype(">f8")[::-1],
        np.array([True, False, True, True])[::2],
    ]
    for arr in cases:
        encoded = wire.encode_tensor(arr)
        assert encoded.value[1].tag in (64, 78, 86)  # always little-endian tags
        back = wire.decode_tensor(cbor2.loads(cbor2.dumps(encoded)), LIMITS)
        assert back.shape == arr.shape
        np.testing.assert_array_equal(back, arr.astype(back.dtype) if arr.dtype != bool else arr)


def test_unsupported_dtypes_do_not_encode() -> None:
    for arr in (np.zeros(2, dtype=np.complex64), np.array(["a"]), np.zeros(1, dtype="M8[s]")):
        with pytest.raises(TypeError):
            wire.encode_tensor(arr)


def test_numpy_values_anywhere_in_a_payload() -> None:
    body = {
        "nested": {"list": [np.arange(3, dtype=np.int16)]},
        "scalars": [np.int64(7), np.float32(0.5), np.bool_(True)],
    }
    decoded = wire.decode_payload(wire.encode_payload(body), LIMITS)
    assert decoded["scalars"] == [7, 0.5, True]
    arr = wire.decode_tensor(decoded["nested"]["list"][0], LIMITS)
    assert arr.dtype == np.int16 and arr.tolist() == [0, 1, 2]
    with pytest.raises(TypeError):
        wire.encode_payload({"x": object()})
    with pytest.raises(TypeError):
        wire.encode_payload([1, 2])  # type: ignore[arg-type]


def test_shape_of_2_to_the_40_elements_is_refused_fast() -> None:
    huge = tensor([1 << 20, 1 << 20], 79, b"\0" * 8)
    started = time.perf_counter()
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(huge, LIMITS, name="token")
    assert time.perf_counter() - started < 0.05
    assert info.value.code == "too_large"
    error = refused(request(inputs={"token": huge}), "too_large")
    assert error.request_id == "req-1"
    # One enormous dimension, and a dimension beyond any limit next to a zero.
    for shape in ([1 << 62], [0, 1 << 70]):
        with pytest.raises(wire.WireError) as info:
            wire.decode_tensor(tensor(shape, 64, b""), LIMITS)
        assert info.value.code == "too_large"


def test_tensor_byte_limit() -> None:
    limits = wire.Limits(max_tensor_bytes=64)
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(tensor([9], 79, b"\0" * 72), limits)
    assert info.value.code == "too_large"
    assert wire.decode_tensor(tensor([8], 79, b"\0" * 64), limits).shape == (8,)


def test_shape_lying_about_its_byte_length() -> None:
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(tensor([2, 3], 78, b"\0" * 20), LIMITS, name="x")
    assert info.value.code == "bad_request"
    assert "shape [2, 3] of int32 needs 24 bytes, got 20" in info.value.message
    with pytest.raises(wire.WireError):
        wire.decode_tensor(CBORTag(79, b"\0" * 12), LIMITS)  # bare: not whole int64s


@pytest.mark.parametrize("dims", [[-1], [2, -3], [True], [1.5], ["2"], [None], "ab", 5])
def test_bad_dimensions(dims: Any) -> None:
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(CBORTag(40, [dims, CBORTag(64, b"\0\0")]), LIMITS)
    assert info.value.code == "bad_request"


@pytest.mark.parametrize(
    "obj",
    [
        b"\0\0",
        [[1], CBORTag(64, b"\0")],
        CBORTag(41, [1, 2]),
        CBORTag(40, [[1]]),
        CBORTag(40, [[1], [0]]),  # untyped array data
        CBORTag(40, [[1], CBORTag(1040, b"\0")]),
        CBORTag(40, [[1], CBORTag(64, "text")]),
        CBORTag(40, "nope"),
    ],
)
def test_things_that_are_not_tensors(obj: Any) -> None:
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(obj, LIMITS)
    assert info.value.code == "bad_request"


def test_rank_limit() -> None:
    ok = [1] * 8
    assert wire.decode_tensor(tensor(ok, 64, b"\0"), LIMITS).ndim == 8
    with pytest.raises(wire.WireError) as info:
        wire.decode_tensor(tensor([1] * 9, 64, b"\0"), LIMITS)
    assert info.value.code == "bad_request" and "rank 9" in info.value.message


# ----------------------------------------------------------------------------- payloads


def test_payload_accepts_bytes_bytearray_and_memoryview() -> None:
    data = cbor2.dumps({"a": 1})
    for form in (data, bytearray(data), memoryview(data)):
        assert wire.decode_payload(form, LIMITS) == {"a": 1}


def test_zstd_payloads() -> None:
    body = {"id": "z-1", "inputs": {"t": np.zeros((64, 64), dtype=np.float32)}}
    plain = wire.encode_payload(body)
    packed = wire.encode_payload(body, compress_over=1024)
    assert packed[:4] == wire.ZSTD_MAGIC and len(packed) < len(plain)
    assert zstandard.frame_content_size(packed) == len(plain)  # receivers can check it first
    assert wire.decode_payload(packed, LIMITS) == wire.decode_payload(plain, LIMITS)
    # Under the threshold, or when compression saves nothing: plain CBOR.
    assert wire.encode_payload(body, compress_over=len(plain)) == plain
    noise = np.random.default_rng(1).bytes(4096)
    assert wire.encode_payload({"n": noise}, compress_over=100)[:4] != wire.ZSTD_MAGIC
    # A frame without a content size decodes too.
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(plain)
    assert zstandard.frame_content_size(unsized) == -1
    assert wire.decode_payload(unsized, LIMITS)["id"] == "z-1"


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
    limits = wire.Limits(max_decompressed_bytes=len(data))
    for sized in (True, False):
        frame = zstandard.ZstdCompressor(write_content_size=sized).compress(data)
        assert wire.decode_payload(frame, limits) == {"b": bytes(5000)}
        small = wire.Limits(max_decompressed_bytes=len(data) - 1)
        assert decode_error(frame, small).code == "too_large"


def test_bad_zstd_frames() -> None:
    frame = zstandard.ZstdCompressor().compress(cbor2.dumps({"a": 1}))
    for data in (wire.ZSTD_MAGIC, frame[:-2], frame + b"\0", frame[:6] + b"\xff" * 20):
        assert decode_error(data).code == "bad_request"
    # The decompressed bytes must be a CBOR map too (no zstd inside zstd).
    nested = zstandard.ZstdCompressor().compress(frame)
    assert decode_error(nested).code == "bad_request"


def test_payload_over_the_size_limit() -> None:
    limits = wire.Limits(max_payload_bytes=4096)
    body = {"id": "big-1", "inputs": {"t": np.ones((1, 4000), dtype=np.int64)}}
    error = decode_error(wire.encode_payload(body), limits)
    assert error.code == "too_large"
    assert error.request_id == "big-1"  # read from the first bytes only, to answer it
    # The look for the id is bounded (64 items), not a decode: an id after that is not seen.
    later = {"inputs": {"t": np.ones((1, 4000), dtype=np.int64)}, "id": "late-1"}
    assert decode_error(wire.encode_payload(later), limits).request_id == "late-1"
    latest = {"params": {"p": list(range(100))}, "inputs": later["inputs"], "id": "late-2"}
    error = decode_error(wire.encode_payload(latest), limits)
    assert error.code == "too_large" and error.request_id is None
    # The limit is on the raw bytes, whatever they hold; at the limit is still decoded.
    assert decode_error(b"\xff" * 4097, limits).code == "too_large"
    at_limit = cbor2.dumps({"b": bytes(4096 - 6)})
    assert len(at_limit) == 4096 and wire.decode_payload(at_limit, limits)
    # zstd frame that declares more than allowed: the id is read from its first bytes.
    frame = wire.encode_payload(body, compress_over=0)
    error = decode_error(frame, wire.Limits(max_decompressed_bytes=4096))
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
        wire.decode_payload(data, LIMITS)
        ours = True
    except wire.WireError:
        ours = False
    assert ours == cbor2_ok == (levels + 1 <= LIMITS.max_depth)


def test_too_many_keys() -> None:
    keys = {f"k{j}": GOOD_TOKEN for j in range(100)}
    error = decode_error(cbor2.dumps({"id": "keys-1", "inputs": keys}))
    assert error.code == "bad_request" and error.request_id == "keys-1"
    assert decode_error(cbor2.dumps({f"k{j}": 1 for j in range(65)})).code == "bad_request"
    assert len(wire.decode_payload(cbor2.dumps({f"k{j}": 1 for j in range(64)}), LIMITS)) == 64
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
    wire._scan(
        buf,
        max_depth=LIMITS.max_depth,
        max_map_keys=LIMITS.max_map_keys,
        max_items=LIMITS.max_items,
    )
    return cbor2.loads(buf, max_depth=LIMITS.max_depth, **wire._LOADS_OPTIONS)


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
            small = wire._decode_small(memoryview(bytes(data)), LIMITS)
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
    assert wire.decode_payload(data, LIMITS) == {"id": "abc", "l": [1, b"x"]}


def test_self_described_cbor_prefix() -> None:
    data = b"\xd9\xd9\xf7" + cbor2.dumps({"a": 1})
    assert wire.decode_payload(data, LIMITS) == {"a": 1}


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
        decoded = wire.decode_payload(cbor2.dumps({"params": chunk}), LIMITS)["params"]
        for key, tag_value in chunk.items():
            assert isinstance(decoded[key], CBORTag), (key, decoded[key])
            assert decoded[key].tag == tag_value.tag


def test_cbor2_decodes_no_tag_the_agent_does_not_keep_raw() -> None:
    """The agent gives cbor2 a keep-it-raw decoder only for the tags cbor2 decodes itself;
    every other tag stays a CBORTag because cbor2 has no decoder for it. A cbor2 release that
    gains one must fail here (the tag then joins wire._BUILTIN_TAGS)."""
    tags = [*range(70_000), 1 << 16 | 5, 1 << 20, 1 << 31, (1 << 32) + 1, 1 << 63, (1 << 64) - 1]
    native = [tag for tag in tags if wire._decoded_natively(tag)]
    assert set(native) <= set(wire._RAW_TAGS)
    assert set(native) == set(wire._BUILTIN_TAGS)  # the list is the real one, not a superset


@pytest.mark.parametrize("tag", [25, 28, 29, 256])
def test_value_sharing_tags_are_refused(tag: int) -> None:
    # 28 over [29(0)] would be a list that contains itself.
    data = cbor2.dumps({"id": "share-1", "x": CBORTag(tag, [CBORTag(29, 0)])})
    error = decode_error(data)
    assert error.code == "bad_request" and error.request_id == "share-1"


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
    assert wire.read_request_id({"id": bad_id}) is None


@pytest.mark.parametrize("bad_id", [17, None, True, b"abc", ["a"]])
def test_ids_that_are_not_text(bad_id: Any) -> None:
    assert refused(request(id=bad_id)).request_id is None
    body = request()
    del body["id"]
    assert refused(body).request_id is None


def test_read_request_id() -> None:
    for good in ("a", "x" * 64, "A.b_c-9", "0"):
        assert wire.read_request_id({"id": good}) == good
        assert wire.ID_PATTERN.match(good)
    assert wire.read_request_id({}) is None
    assert wire.read_request_id({"id": "abc\n"}) is None
    assert wire.ID_PATTERN.match("abc\n") is None
    assert wire.read_request_id([("id", "x")]) is None  # type: ignore[arg-type]


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
    payload = wire.decode_payload(cbor2.dumps(request(reply_to="apps/x/replies")), LIMITS)
    req = wire.parse_request(payload, "m", LIMITS, allowed_reply_prefixes=["edge/", "apps/x/"])
    assert req.reply_to == "apps/x/replies"
    with pytest.raises(wire.WireError):
        wire.parse_request(payload, "m", LIMITS, allowed_reply_prefixes=[])


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
    with pytest.raises(wire.WireError) as info:
        wire.validate_inputs("r-1", inputs, specs)
    assert info.value.code == "bad_request" and info.value.request_id == "r-1"
    return info.value.message


def test_validate_inputs_in_spec_order() -> None:
    checked = wire.validate_inputs("r-1", good_inputs(), SPECS)
    assert list(checked) == ["ids", "mask", "scale"]
    assert checked["mask"].dtype == np.bool_
    assert checked["mask"].tolist() == [[True, False, True, True]]
    bigger = good_inputs() | {"ids": np.zeros((7, 4), np.int64), "mask": np.ones((3, 4), bool)}
    assert wire.validate_inputs("r-1", bigger, SPECS)["ids"].shape == (7, 4)


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


# ----------------------------------------------------------------------------- replies


def test_reply_envelope_and_gone() -> None:
    before = time.time_ns()
    msg = wire.reply_envelope(
        request_id="r-1", seq=3, type="chunk", model="m", version=2, index=0, outputs={}
    )
    assert msg["v"] == 1 and msg["id"] == "r-1" and msg["seq"] == 3 and msg["type"] == "chunk"
    assert msg["model"] == "m" and msg["version"] == 2 and msg["index"] == 0
    assert before <= msg["ts"] <= time.time_ns()
    assert wire.gone_message("r-1") == {"v": 1, "id": "r-1", "type": "gone", "seq": None}
    decoded = wire.decode_payload(wire.encode_payload(wire.gone_message("r-1")), LIMITS)
    assert decoded["seq"] is None


def test_parts_split_and_reassemble() -> None:
    outputs = {
        "logits": np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32),
        "token": np.array([[7]], dtype=np.int64),
        "done": np.array([True]),
    }
    data = wire.encode_outputs(outputs)
    assert wire.decode_payload(data, LIMITS).keys() == outputs.keys()
    for size in (1, 7, 100, len(data) - 1, len(data), len(data) * 2):
        parts = wire.split_parts(data, size)
        assert all(0 < len(p) <= size for p in parts)
        assert len(parts) == -(-len(data) // size)
        assert b"".join(parts) == data
        back = wire.reassemble_parts(parts)
        assert list(back) == list(outputs)
        np.testing.assert_array_equal(back["logits"], outputs["logits"])
        assert back["token"].tolist() == [[7]] and back["done"].tolist() == [1]
    with pytest.raises(ValueError):
        wire.split_parts(data, 0)
    parts = wire.split_parts(data, 100)
    with pytest.raises(wire.WireError):
        wire.reassemble_parts(parts[:-1])
    # Parts are not bound by the payload limit, only by what they decode to.
    big = wire.encode_outputs({"x": np.zeros(2 << 20, dtype=np.float32)})
    assert len(big) > LIMITS.max_payload_bytes
    assert wire.reassemble_parts(wire.split_parts(big, 1 << 20))["x"].shape == (2 << 20,)
    with pytest.raises(wire.WireError):
        wire.reassemble_parts(
            [big], limits=wire.Limits(max_payload_bytes=1 << 40, max_tensor_bytes=1024)
        )


# ----------------------------------------------------------------------------- misc


def test_wire_error_fields() -> None:
    error = wire.WireError("too_large", "line one\nline two", "r-1")
    assert (error.code, error.message, error.request_id) == (
        "too_large",
        "line one line two",
        "r-1",
    )
    assert wire.WireError("bad_request", "x").request_id is None
    with pytest.raises(ValueError):
        wire.WireError("nope", "x")
    assert len(wire.WireError("bad_request", "y" * 10_000).message) <= 300
    assert {
        "bad_request",
        "unknown_model",
        "unknown_version",
        "too_large",
        "overloaded",
        "deadline_exceeded",
        "model_error",
        "shutting_down",
    } == wire.ERROR_CODES


def test_limits_are_validated() -> None:
    assert wire.Limits().max_payload_bytes == 4 * 1024 * 1024
    for bad in ({"max_depth": 0}, {"max_rank": -1}, {"max_tensors": True}):
        with pytest.raises(ValueError):
            wire.Limits(**bad)


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
        wire.encode_payload(
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
            payload = wire.decode_payload(data, LIMITS)
            req = wire.parse_request(payload, "m", LIMITS, allowed_reply_prefixes=PREFIXES)
            for arr in req.inputs.values():
                assert arr.nbytes <= LIMITS.max_tensor_bytes
            outcomes["ok"] += 1
        except wire.WireError as e:
            assert e.code in wire.ERROR_CODES and e.message
            assert e.request_id is None or wire.ID_PATTERN.match(e.request_id)
            outcomes["error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > 1000


# ----------------------------------------------------------------------------- reply encoding


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array(5, dtype=np.int64),
        np.zeros((0, 3), dtype=np.int32),
        np.array([True, False]),
        np.arange(10, dtype=">f4"),  # big-endian: swapped once
        np.arange(12, dtype=np.int16).reshape(3, 4).T,  # not contiguous: gathered once
        np.zeros((1, 70000), dtype=np.uint8),  # a byte-string head of 4 bytes
        np.array([1, 2], dtype=np.float16),
        np.arange(5, dtype=np.uint64),
    ],
)
def test_outputs_are_built_from_buffers_with_cbor2s_bytes(arr: np.ndarray) -> None:
    """The hand-built encoding is the one cbor2 makes from `encode_tensor` tags, byte for byte."""
    outputs = {"x": arr, "second": arr}
    expected = cbor2.dumps({name: wire.encode_tensor(a) for name, a in outputs.items()})
    assert wire.encode_outputs(outputs) == expected
    pieces, size = wire.outputs_pieces(outputs)
    assert size == len(expected) == len(b"".join(pieces))


def test_a_result_envelope_is_the_generic_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.inference import streaming

    monkeypatch.setattr(time, "time_ns", lambda: 1_234_567_890_123_456_789)
    outputs = {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([300], np.int64)}
    timing = {"queue_ms": 0.25, "infer_ms": 1.5, "total_ms": 2.0}
    payloads = []
    for request_id, version in (("abc", 3), ("x" * 40, 3), ("abc", 70000)):  # cached middle, new
        sent: list = []
        reply = streaming.ReplyStream(
            request_id=request_id, model="m", version=version, topic="t", qos=1,
            max_chunk_bytes=1 << 20, send=sent.append,
        )  # fmt: skip
        reply.seq = 30  # a result after chunks: seq takes two bytes
        assert reply.result(outputs, timing)
        reply.seq = 30
        generic = streaming.encode_with_outputs(
            reply._fields("result", timing=timing), wire.encode_outputs(outputs)
        )
        assert sent[0].payload == generic
        decoded = wire.decode_payload(generic, LIMITS)
        assert (decoded["id"], decoded["version"], decoded["seq"]) == (request_id, version, 30)
        payloads.append(sent[0].payload)
    assert len(set(payloads)) == 3


def test_a_chunk_envelope_is_the_generic_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.inference import streaming

    monkeypatch.setattr(time, "time_ns", lambda: 1_234_567_890_123_456_789)
    sent: list = []
    reply = streaming.ReplyStream(
        request_id="abc", model="m", version=3, topic="t", qos=1,
        max_chunk_bytes=1 << 20, send=sent.append,
    )  # fmt: skip
    outputs = {"next_token": np.array([[7]], np.int64), "p": np.ones((2, 3), np.float32)}
    reply.chunk(outputs, 5)
    reply.seq = 0
    generic = streaming.encode_with_outputs(
        reply._fields("chunk", index=5), wire.encode_outputs(outputs)
    )
    assert sent[0].payload == generic
    assert wire.decode_payload(generic, LIMITS)["index"] == 5
