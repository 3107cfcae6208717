"""RFC 8746 tensors: every dtype both ways, the limits on shapes, and reply outputs built by
hand with the bytes cbor2 makes."""

from __future__ import annotations

import struct
import time
from typing import Any

import cbor2
import numpy as np
import pytest
from cbor2 import CBORTag

from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload, encode_payload
from agent.protocol.tensors import decode_tensor, encode_outputs, encode_tensor, outputs_pieces
from tests.protocol_helpers import LIMITS, refused, request, tensor

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
    encoded = encode_tensor(arr)
    assert encoded.tag == 40
    assert list(encoded.value[0]) == [2, 3]
    assert encoded.value[1].tag == tag
    payload = decode_payload(encode_payload({"t": arr}), LIMITS)
    back = decode_tensor(payload["t"], LIMITS)
    assert back.dtype == np.dtype(dtype)
    assert back.shape == (2, 3)
    np.testing.assert_array_equal(back, arr)


def test_bool_travels_as_uint8() -> None:
    arr = np.array([[True, False], [False, True]])
    encoded = encode_tensor(arr)
    assert encoded.value[1].tag == 64
    assert encoded.value[1].value == b"\x01\x00\x00\x01"
    back = decode_tensor(cbor2.loads(cbor2.dumps(encoded)), LIMITS)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back.view(bool), arr)


def test_scalar_and_empty_tensors() -> None:
    for arr in (np.array(3.5, dtype=np.float32), np.zeros((0, 4), dtype=np.int32)):
        back = decode_tensor(cbor2.loads(cbor2.dumps(encode_tensor(arr))), LIMITS)
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
    payload = decode_payload(cbor2.dumps(body), LIMITS)
    for key, shape in (("t", (2, 3)), ("flat", (6,))):
        arr = decode_tensor(payload[key], LIMITS, name=key)
        assert arr.shape == shape
        assert arr.dtype == wire_dtype.newbyteorder("=")
        assert arr.dtype.isnative
        np.testing.assert_array_equal(arr.reshape(2, 3), values.astype(arr.dtype))


def test_big_endian_bytes_are_converted() -> None:
    arr = decode_tensor(tensor([2], 74, b"\x00\x00\x01\x00\xff\xff\xff\xfe"), LIMITS)
    assert arr.tolist() == [256, -2]
    arr = decode_tensor(tensor([1], 82, struct.pack(">d", 1.25)), LIMITS)
    assert arr.tolist() == [1.25]


@pytest.mark.parametrize("tag", [76, 83, 87])
def test_reserved_and_float128_tags_are_refused(tag: int) -> None:
    with pytest.raises(WireError) as info:
        decode_tensor(tensor([1], tag, b"\0" * 16), LIMITS, name="x")
    assert info.value.code == "bad_request"
    assert str(tag) in info.value.message


def test_little_endian_decode_is_zero_copy() -> None:
    raw = np.arange(12, dtype="<f4").tobytes()
    tag = CBORTag(85, raw)
    arr = decode_tensor(CBORTag(40, [(3, 4), tag]), LIMITS)
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
        encoded = encode_tensor(arr)
        assert encoded.value[1].tag in (64, 78, 86)  # always little-endian tags
        back = decode_tensor(cbor2.loads(cbor2.dumps(encoded)), LIMITS)
        assert back.shape == arr.shape
        np.testing.assert_array_equal(back, arr.astype(back.dtype) if arr.dtype != bool else arr)


def test_unsupported_dtypes_do_not_encode() -> None:
    for arr in (np.zeros(2, dtype=np.complex64), np.array(["a"]), np.zeros(1, dtype="M8[s]")):
        with pytest.raises(TypeError):
            encode_tensor(arr)


def test_numpy_values_anywhere_in_a_payload() -> None:
    body = {
        "nested": {"list": [np.arange(3, dtype=np.int16)]},
        "scalars": [np.int64(7), np.float32(0.5), np.bool_(True)],
    }
    decoded = decode_payload(encode_payload(body), LIMITS)
    assert decoded["scalars"] == [7, 0.5, True]
    arr = decode_tensor(decoded["nested"]["list"][0], LIMITS)
    assert arr.dtype == np.int16 and arr.tolist() == [0, 1, 2]
    with pytest.raises(TypeError):
        encode_payload({"x": object()})
    with pytest.raises(TypeError):
        encode_payload([1, 2])  # type: ignore[arg-type]


def test_shape_of_2_to_the_40_elements_is_refused_fast() -> None:
    huge = tensor([1 << 20, 1 << 20], 79, b"\0" * 8)
    started = time.perf_counter()
    with pytest.raises(WireError) as info:
        decode_tensor(huge, LIMITS, name="token")
    assert time.perf_counter() - started < 0.05
    assert info.value.code == "too_large"
    error = refused(request(inputs={"token": huge}), "too_large")
    assert error.request_id == "req-1"
    # One enormous dimension, and a dimension beyond any limit next to a zero.
    for shape in ([1 << 62], [0, 1 << 70]):
        with pytest.raises(WireError) as info:
            decode_tensor(tensor(shape, 64, b""), LIMITS)
        assert info.value.code == "too_large"


def test_tensor_byte_limit() -> None:
    limits = Limits(max_tensor_bytes=64)
    with pytest.raises(WireError) as info:
        decode_tensor(tensor([9], 79, b"\0" * 72), limits)
    assert info.value.code == "too_large"
    assert decode_tensor(tensor([8], 79, b"\0" * 64), limits).shape == (8,)


def test_shape_lying_about_its_byte_length() -> None:
    with pytest.raises(WireError) as info:
        decode_tensor(tensor([2, 3], 78, b"\0" * 20), LIMITS, name="x")
    assert info.value.code == "bad_request"
    assert "shape [2, 3] of int32 needs 24 bytes, got 20" in info.value.message
    with pytest.raises(WireError):
        decode_tensor(CBORTag(79, b"\0" * 12), LIMITS)  # bare: not whole int64s


@pytest.mark.parametrize("dims", [[-1], [2, -3], [True], [1.5], ["2"], [None], "ab", 5])
def test_bad_dimensions(dims: Any) -> None:
    with pytest.raises(WireError) as info:
        decode_tensor(CBORTag(40, [dims, CBORTag(64, b"\0\0")]), LIMITS)
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
    with pytest.raises(WireError) as info:
        decode_tensor(obj, LIMITS)
    assert info.value.code == "bad_request"


def test_rank_limit() -> None:
    ok = [1] * 8
    assert decode_tensor(tensor(ok, 64, b"\0"), LIMITS).ndim == 8
    with pytest.raises(WireError) as info:
        decode_tensor(tensor([1] * 9, 64, b"\0"), LIMITS)
    assert info.value.code == "bad_request" and "rank 9" in info.value.message


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
    expected = cbor2.dumps({name: encode_tensor(a) for name, a in outputs.items()})
    assert encode_outputs(outputs) == expected
    pieces, size = outputs_pieces(outputs)
    assert size == len(expected) == len(b"".join(pieces))
