"""ONNX values beyond numeric tensors (agent.protocol.values): string tensors both ways,
sequences and maps as outputs, the client's decoding, and outputs with no wire form failing
their request with `model_error` while numeric outputs keep their hand-built bytes."""

from __future__ import annotations

from typing import Any

import cbor2
import numpy as np
import pytest
from cbor2 import CBORTag

from agent.client.reply import Reply, decode_outputs
from agent.inference.reply_stream import OutputNotEncodable, ReplyRefused, ReplyStream
from agent.models.backends.base import TensorSpec
from agent.protocol.errors import Limits, WireError
from agent.protocol.payload import decode_payload
from agent.protocol.requests import validate_inputs
from agent.protocol.tensors import decode_tensor, encode_outputs, encode_tensor, outputs_pieces
from agent.protocol.values import decode_value, encode_value, value_nbytes
from tests.protocol_helpers import LIMITS, parse, refused, request


def strings(shape: tuple[int, ...], texts: list[str]) -> np.ndarray:
    arr = np.empty(len(texts), dtype=object)
    arr[:] = texts
    return arr.reshape(shape)


def over_the_wire(outputs: dict[str, Any]) -> dict[str, Any]:
    """Outputs encoded as a reply carries them, then decoded as the client decodes them."""
    return decode_outputs(decode_payload(encode_outputs(outputs), LIMITS))


def same(a: Any, b: Any) -> bool:
    """Deep equality where numpy arrays compare by dtype, shape and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.all(a == b))
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------- string tensors

STRING_TENSORS = [
    strings((), ["scalar"]),
    strings((3,), ["a", "", "ünïcødé ✓"]),
    strings((2, 2), ["x", "yy", "zzz", "日本"]),
    strings((1, 2, 3), [str(i) for i in range(6)]),
    strings((0,), []),
    strings((2, 0, 3), []),
]


@pytest.mark.parametrize("arr", STRING_TENSORS, ids=lambda a: f"shape{a.shape}")
def test_string_tensors_round_trip_as_outputs(arr: np.ndarray) -> None:
    back = over_the_wire({"labels": arr})["labels"]
    assert same(back, arr)
    assert all(type(t) is str for t in back.ravel())


@pytest.mark.parametrize("arr", STRING_TENSORS, ids=lambda a: f"shape{a.shape}")
def test_string_tensors_round_trip_as_inputs(arr: np.ndarray) -> None:
    req = parse(request(inputs={"text": cbor2.loads(encode_value(arr))}))
    assert same(req.inputs["text"], arr)


def test_the_bytes_of_a_string_tensor() -> None:
    wire = encode_value(strings((2,), ["a", "bc"]))
    # tag 40, array(2), shape [2], array(2) of "a" and "bc"
    assert wire == bytes.fromhex("d828828102826161626263")
    assert wire == cbor2.dumps(CBORTag(40, [[2], ["a", "bc"]]))


def test_numpy_str_arrays_travel_as_string_tensors() -> None:
    back = over_the_wire({"s": np.array([["ab", "c"]])})["s"]
    assert same(back, strings((1, 2), ["ab", "c"]))


# ---------------------------------------------------------------------- sequences and maps


def test_zipmap_outputs_round_trip_with_int_and_text_keys() -> None:
    probs = np.array([[0.1, 0.9], [0.75, 0.25]], dtype=np.float32)
    by_int = [{0: float(p[0]), 1: float(p[1])} for p in probs]  # ZipMap: Python floats
    by_text = [{"cat": float(p[0]), "dog": float(p[1])} for p in probs]
    outputs = {"label": np.array([1, 0], np.int64), "by_int": by_int, "by_text": by_text}
    back = over_the_wire(outputs)
    assert same(back, outputs)
    # float32 values stay exact: written in their shortest exact form, never rounded
    assert back["by_int"][0][0] == float(np.float32(0.1))


def test_maps_with_numbers_and_tensors() -> None:
    outputs = {
        "counts": {"a": 1, "b": -2, 7: 0.5},
        "tensors": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), 3: strings((1,), ["t"])},
        "numpy_scalars": {np.int64(4): np.float32(0.5), "flag": np.bool_(True)},
    }
    back = over_the_wire(outputs)
    assert back["counts"] == {"a": 1, "b": -2, 7: 0.5}
    assert same(back["tensors"], outputs["tensors"])
    assert back["numpy_scalars"] == {4: 0.5, "flag": True}


def test_nested_sequences_of_tensors() -> None:
    outputs = {
        "seq": [np.ones((2, 2), np.int32), np.zeros(0, np.float64)],
        "nested": [[np.array([1.5], np.float16)], [], [strings((1,), ["s"])]],
        "empty": [],
    }
    assert same(over_the_wire(outputs), outputs)


def test_tuples_travel_as_sequences() -> None:
    assert over_the_wire({"t": (1, 2.5, "x")})["t"] == [1, 2.5, "x"]


def test_decode_value_leaves_other_tags_and_bounds_depth() -> None:
    assert decode_value(CBORTag(1234, 5), LIMITS) == CBORTag(1234, 5)
    deep: Any = 1
    for _ in range(LIMITS.max_depth + 1):
        deep = [deep]
    with pytest.raises(WireError, match="nested too deeply"):
        decode_value(deep, LIMITS, name="d")


# -------------------------------------------------------------- outputs with no wire form


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({1, 2}, ["set"]),
        (np.zeros(2, dtype=np.complex64), ["complex64", "tensor(complex64) [2]"]),
        (np.zeros(3, dtype="V2"), ["void16", "no wire form"]),  # bfloat16 as numpy sees it
        (np.zeros(1, dtype="M8[s]"), ["datetime64"]),
        ([{0: 0.5}, {1: 1j}], ["list of 2", "at [1][1]", "complex"]),
        ([{0.5: 1.0}], ["map key 0.5", "not an integer or text"]),
        ([{True: 1.0}], ["map key True"]),
        ({"a": Opaque()}, ["dict of 1", "at ['a']", "Opaque"]),
        (strings((2,), ["a", "b"]), []),  # the control: strings do encode
        (np.array(["a", 3], dtype=object), ["element 1 of a string tensor is int"]),
        (None, ["NoneType"]),
        (b"raw", ["bytes"]),
        ([np.complex64(1)], ["complex64"]),
    ],
)
def test_values_with_no_wire_form_raise_naming_the_output(value: Any, words: list[str]) -> None:
    if not words:
        encode_outputs({"out": value})
        return
    with pytest.raises(TypeError) as info:
        encode_outputs({"first": np.ones(1, np.float32), "out": value})
    message = str(info.value)
    assert message.startswith("output 'out' (")
    for word in words:
        assert word in message, message


def test_nesting_is_bounded() -> None:
    deep: Any = 1.0
    for _ in range(100):
        deep = [deep]
    with pytest.raises(TypeError, match="nested deeper than"):
        encode_value(deep, "deep")


# ---------------------------------------------------------------- numeric: the hot path


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array(3, dtype=np.int64),
        np.array([1, 0], dtype=np.bool_),
        np.arange(4, dtype=">f8"),
        np.arange(12, dtype=np.int16).reshape(3, 4).T,
        np.array([0.5, 2], dtype=np.float16),
    ],
)
def test_numeric_outputs_keep_their_bytes_and_single_copy(arr: np.ndarray) -> None:
    outputs = {"x": arr, "labels": strings((1,), ["a"])}
    expected = cbor2.dumps({"x": encode_tensor(arr), "labels": CBORTag(40, [[1], ["a"]])})
    pieces, size = outputs_pieces(outputs)
    assert b"".join(pieces) == expected and size == len(expected)
    if arr.flags.c_contiguous and arr.dtype.isnative and arr.dtype != np.bool_:
        assert pieces[3] is arr  # the array itself: copied once, by the join


# ------------------------------------------------------------------- requests: string inputs


def string_input(shape: list[int], texts: list[Any]) -> dict[str, Any]:
    return request(inputs={"text": CBORTag(40, [shape, texts])})


def test_a_string_input_decodes_to_an_object_array_of_str() -> None:
    arr = parse(string_input([2, 1], ["héllo", ""])).inputs["text"]
    assert arr.dtype == np.dtype(object) and arr.shape == (2, 1)
    assert arr.tolist() == [["héllo"], [""]]


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (string_input([3], ["a", "b"]), "bad_request", "needs 3 texts, got 2"),
        (string_input([1], ["a", "b"]), "bad_request", "needs 1 texts, got 2"),
        (string_input([2], ["a", 5]), "bad_request", "element 1 of a string tensor is int"),
        (string_input([1], [b"a"]), "bad_request", "element 0 of a string tensor is bytes"),
        (string_input([1] * 9, ["a"]), "bad_request", "rank 9 exceeds"),
        (string_input([1 << 30], []), "too_large", "exceeds the limit of"),
        (string_input([1 << 12, 1 << 12, 2], []), "too_large", "exceeds the limit of"),
        (request(inputs={"text": CBORTag(40, [[1], "a"])}), "bad_request", "array of text"),
    ],
)
def test_string_inputs_are_held_to_the_limits(body: dict[str, Any], code: str, words: str) -> None:
    error = refused(body, code)
    assert "tensor 'text'" in error.message and words in error.message, error.message
    assert error.request_id == "req-1"


def test_a_string_inputs_utf8_bytes_are_bounded() -> None:
    limits = Limits(max_tensor_bytes=8)
    texts = ["ééé", "é"]  # 4 characters, 8 UTF-8 bytes: at the limit
    assert decode_tensor(CBORTag(40, [[2], texts]), limits).tolist() == texts
    with pytest.raises(WireError) as info:
        decode_tensor(CBORTag(40, [[2], [*texts[:1], "éa"]]), limits, name="t")
    assert info.value.code == "too_large" and "9 UTF-8 bytes" in info.value.message


STRING_SPECS = [
    TensorSpec("text", np.dtype(object), ("batch",)),
    TensorSpec("x", np.dtype(np.float32), ("batch",)),
]


def invalid(inputs: dict[str, Any]) -> str:
    with pytest.raises(WireError) as info:
        validate_inputs("r-1", inputs, STRING_SPECS)
    assert info.value.code == "bad_request" and info.value.request_id == "r-1"
    return info.value.message


def test_validate_inputs_takes_string_tensors_for_string_inputs() -> None:
    text = strings((2,), ["a", "b"])
    checked = validate_inputs("r-1", {"x": np.ones(2, np.float32), "text": text}, STRING_SPECS)
    assert list(checked) == ["text", "x"] and checked["text"] is text
    local = validate_inputs(
        "r-1", {"x": np.ones(1, np.float32), "text": np.array(["u"])}, STRING_SPECS
    )
    assert local["text"].dtype == np.dtype(object) and local["text"].tolist() == ["u"]


def test_validate_inputs_names_string_and_numeric_mismatches() -> None:
    numeric_for_string = invalid({"text": np.ones(2, np.float32), "x": np.ones(2, np.float32)})
    assert numeric_for_string == (
        "input 'text' has dtype float32, expected string (tag 40 over [shape, [text, ...]])"
    )
    string_for_numeric = invalid({"text": strings((1,), ["a"]), "x": strings((1,), ["b"])})
    assert string_for_numeric == "input 'x' is a string tensor, expected float32"


# ---------------------------------------------------------------------------- reply streams


def stream(max_chunk_bytes: int = 1 << 20) -> ReplyStream:
    return ReplyStream(
        request_id="r", model="m", version=1, topic="t", qos=1, max_chunk_bytes=max_chunk_bytes
    )


def test_an_unencodable_chunk_fails_the_request_with_model_error() -> None:
    reply = stream()
    reply.chunk({"y": np.ones(2, np.float32)}, 0)
    with pytest.raises(OutputNotEncodable) as info:
        reply.chunk({"y": np.ones(2, np.float32), "z": np.zeros(2, np.complex128)}, 1)
    error = info.value
    assert isinstance(error, ReplyRefused) and isinstance(error, WireError)
    assert error.code == "model_error"
    assert error.message.startswith("output 'z' (tensor(complex128) [2]) cannot be encoded")
    assert reply.seq == 1 and reply.chunks == 1  # nothing made, no number taken
    assert reply.error(error.code, error.message)  # what the driver does with it
    messages = [decode_payload(m.payload, LIMITS) for m in reply.drain()]
    assert [(m["type"], m["seq"]) for m in messages] == [("chunk", 0), ("error", 1)]
    assert messages[1]["code"] == "model_error" and "output 'z'" in messages[1]["message"]


def test_an_unencodable_result_fails_the_request_and_makes_nothing() -> None:
    reply = stream()
    with pytest.raises(OutputNotEncodable, match="output 's' \\(set\\)"):
        reply.result({"s": {1, 2}}, {"total_ms": 1.0})
    assert not reply.finished and reply.drain() == []
    assert reply.error("model_error", "x")


def test_a_stream_of_values_reaches_the_client() -> None:
    reply = stream(max_chunk_bytes=1024)  # the second chunk needs parts
    zipmap = [{0: 0.25, 1: 0.75}]
    reply.chunk({"probs": zipmap, "label": strings((1,), ["dog"])}, 0)
    many = [{i: 0.5} for i in range(200)]
    reply.chunk({"probs": many, "label": strings((2,), ["a" * 400, "b" * 400])}, 1)
    reply.hold({"probs": many})  # counted by an estimate, no crash
    assert reply.end({"total_ms": 1.0})
    messages = reply.drain()
    assert len(messages) > 3  # parts
    iterated, collected = (Reply(request_id="r", topic="t", timeout=5.0) for _ in range(2))
    for message in messages:
        for client in (iterated, collected):
            client._deliver(decode_payload(message.payload, LIMITS))
    chunks = list(iterated)
    assert [c.index for c in chunks] == [0, 1]
    assert chunks[0].outputs["probs"] == zipmap and chunks[1].outputs["probs"] == many
    whole = collected.collect()  # lists chained, string tensors concatenated
    assert whole["probs"] == zipmap + many
    assert whole["label"].tolist() == ["dog", "a" * 400, "b" * 400]


def test_value_nbytes_estimates_containers() -> None:
    assert value_nbytes(np.ones(4, np.float32)) == 16
    assert value_nbytes([{0: 0.5, 1: 0.5}]) == 36
    assert value_nbytes(strings((2,), ["a", "b"])) > 0


def test_an_object_input_that_is_not_a_string_tensor_is_refused_for_what_it_is() -> None:
    """Inputs of dtype object that are not string tensors (bfloat16, sequences, maps) are
    refused by their ONNX type, whatever was sent."""
    Spec = TensorSpec
    specs = [Spec("b", np.dtype(object), (2,), "tensor(bfloat16)")]
    for sent in (np.ones(2, np.float32), strings((2,), ["a", "b"])):
        with pytest.raises(WireError) as info:
            validate_inputs("r-1", {"b": sent}, specs)
        assert info.value.message == "input 'b' is tensor(bfloat16), which no request can carry"
    specs = [Spec("s", np.dtype(object), (2,), "tensor(string)")]
    assert validate_inputs("r-1", {"s": strings((2,), ["a", "b"])}, specs)["s"].shape == (2,)
