"""Non-tensor types load; the inventory lists each ready version's signature and metadata,
within the message limit; the ONNX header is read by hand, without `onnx`."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from agent.cli import build_parser
from agent.client import AgentError
from agent.models.backends.base import (
    BackendOptions,
    InferenceError,
    TensorSpec,
    session_metadata,
)
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession
from agent.models.manager import ModelManager
from agent.models.model_config import ModelConfig
from agent.models.onnx_header import MAX_PROPS, MAX_TEXT, parse_header, read_header
from agent.models.records import (
    LoadedVersion,
    ModelRecord,
    VersionRecord,
    format_inventory,
    inventory_of,
)
from agent.protocol.payload import encode_payload
from benchmarks.inventory_size import FakeSession, decoder_specs, inventory_size

ZIPMAP = "seq(map(int64,tensor(float)))"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    *,
    opsets: dict[str, int] | None = None,
    props: dict[str, str] | None = None,
    **fields: Any,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opset_ids = [helper.make_opsetid(d, v) for d, v in (opsets or {"": 17}).items()]
    model = helper.make_model(graph, opset_imports=opset_ids, ir_version=8, **fields)
    if props:
        helper.set_model_props(model, props)
    return model


def classifier() -> onnx.ModelProto:
    """What skl2onnx makes of a classifier, in small: string inputs and labels, and ZipMap's
    list of {class: probability}."""
    zipmap = helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(1, []))
    )
    return _model(
        [
            helper.make_node(
                "ZipMap",
                ["probs"],
                ["probabilities"],
                domain="ai.onnx.ml",
                classlabels_int64s=[0, 1, 2],
            ),
            helper.make_node("Identity", ["names"], ["label"]),
            helper.make_node("Identity", ["probs"], ["scores"]),
        ],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, [None, 3]),
            helper.make_tensor_value_info("names", TensorProto.STRING, ["N"]),
        ],
        [
            helper.make_value_info("probabilities", zipmap),
            helper.make_tensor_value_info("label", TensorProto.STRING, ["N"]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3]),
        ],
        opsets={"": 17, "ai.onnx.ml": 3},
        props={"author": "tests", "classes": "0,1,2"},
        producer_name="skl2onnx",
        producer_version="1.16.0",
        domain="ai.onnx",
    )


def _load(tmp_path: Path, model: onnx.ModelProto, name: str = "model.onnx") -> OnnxSession:
    path = tmp_path / name
    onnx.save(model, str(path))
    return OnnxRuntimeBackend().load(path, BackendOptions())


def _by_name(specs: Any) -> dict[str, TensorSpec]:
    return {spec.name: spec for spec in specs}


# --------------------------------------------------------------------------- specs


def test_a_classifier_with_strings_and_zipmap_loads(tmp_path: Path) -> None:
    session = _load(tmp_path, classifier())
    inputs, outputs = _by_name(session.inputs), _by_name(session.outputs)
    assert [(s.onnx_type, s.dtype, s.shape) for s in inputs.values()] == [
        ("tensor(float)", np.dtype(np.float32), (None, 3)),
        ("tensor(string)", np.dtype(object), ("N",)),
    ]
    probabilities, label, scores = outputs["probabilities"], outputs["label"], outputs["scores"]
    assert (probabilities.type, probabilities.dtype, probabilities.shape) == (
        ZIPMAP,
        np.dtype(object),
        (),
    )
    assert not probabilities.is_tensor and not probabilities.is_numeric
    assert label.is_tensor and not label.is_numeric and label.shape == ("N",)
    assert scores.is_numeric and scores.shape == (None, 3)
    assert probabilities.describe() == f"probabilities: {ZIPMAP}"
    assert label.describe() == "label: tensor(string)[?]"
    assert scores.describe() == "scores: float32[?,3]"
    out = session.run({"probs": np.ones((2, 3), np.float32), "names": np.array(["a", "b"], object)})
    assert out["probabilities"] == [{0: 1.0, 1: 1.0, 2: 1.0}] * 2
    assert out["label"].tolist() == ["a", "b"]


def test_bfloat16_and_sequence_inputs_load_and_fail_only_when_run(tmp_path: Path) -> None:
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    model = _model(
        [
            helper.make_node("Identity", ["b"], ["b_out"]),
            helper.make_node("SequenceLength", ["s"], ["n"]),
        ],
        [
            helper.make_tensor_value_info("b", TensorProto.BFLOAT16, ["batch", 4]),
            helper.make_value_info("s", seq),
        ],
        [
            helper.make_tensor_value_info("b_out", TensorProto.BFLOAT16, ["batch", 4]),
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
        ],
    )
    session = _load(tmp_path, model)
    b, s = session.inputs
    assert (b.type, b.dtype, b.shape, b.is_tensor, b.is_numeric) == (
        "tensor(bfloat16)",
        np.dtype(object),
        ("batch", 4),
        True,
        False,
    )
    assert b.describe() == "b: tensor(bfloat16)[?,4]"
    assert (s.type, s.dtype, s.shape) == ("seq(tensor(float))", np.dtype(object), ())
    with pytest.raises(InferenceError):
        session.run({"b": np.zeros((1, 4), object), "s": np.zeros((), object)})


def test_an_output_numpy_cannot_hold_fails_only_the_requests_that_ask_for_it(
    tmp_path: Path, broker: Any, make_agent: Any, make_client: Any
) -> None:
    """ONNX Runtime cannot hand a bfloat16 output to Python, and fetching it failed every
    run: it is never fetched now, and only a request naming it fails, told why."""
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["y"]),
            helper.make_node("Cast", ["x"], ["z"], to=TensorProto.BFLOAT16),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("z", TensorProto.BFLOAT16, ["batch", 4]),
        ],
    )
    (tmp_path / "models" / "half" / "1").mkdir(parents=True)
    onnx.save(model, str(tmp_path / "models" / "half" / "1" / "model.onnx"))
    agent = make_agent(broker, tmp_path / "models")
    client = make_client(broker, agent)
    version = agent.models.inventory()["models"]["half"]["versions"]["1"]
    assert version["state"] == "ready" and version["warmup"] == "ok"
    x = np.array([[-1.0, 0.5, 2.0, -3.0]], np.float32)
    reply = client.request("half", {"x": x}, stream=False)
    assert set(reply.collect()) == {"y"}
    assert reply.collect()["y"].tolist() == [[0.0, 0.5, 2.0, 0.0]]
    with pytest.raises(AgentError) as info:
        client.request("half", {"x": x}, params={"outputs": ["z"]}, stream=False).collect()
    assert info.value.code == "model_error"
    assert "'z' is tensor(bfloat16)" in info.value.message


def test_a_spec_without_a_type_takes_its_dtypes_and_equals_the_loaded_one(tmp_path: Path) -> None:
    plain = TensorSpec("probs", np.dtype(np.float32), (None, 3))
    assert plain.type == plain.onnx_type == "tensor(float)"
    assert plain.is_tensor and plain.is_numeric
    assert TensorSpec("m", np.dtype(np.bool_), ()).onnx_type == "tensor(bool)"
    assert TensorSpec("d", np.dtype(np.float64), ()).onnx_type == "tensor(double)"
    assert _load(tmp_path, classifier()).inputs[0] == plain


# --------------------------------------------------------------------------- the header


def test_the_header_reads_producer_opsets_and_props(tmp_path: Path) -> None:
    path = tmp_path / "clf.onnx"
    onnx.save(classifier(), str(path))
    header = read_header(path)
    assert header is not None and header.complete
    assert (header.ir_version, header.producer_name, header.producer_version, header.domain) == (
        8,
        "skl2onnx",
        "1.16.0",
        "ai.onnx",
    )
    assert header.opsets == {"": 17, "ai.onnx.ml": 3}
    assert header.props == {"author": "tests", "classes": "0,1,2"}
    assert header.metadata() == {
        "producer": "skl2onnx",
        "producer_version": "1.16.0",
        "domain": "ai.onnx",
        "opset": 17,
        "opset_ml": 3,
        "props": {"author": "tests", "classes": "0,1,2"},
    }
    # ONNX Runtime's own reading agrees where it has the fields.
    import onnxruntime as ort

    meta = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta()
    assert (meta.producer_name, meta.domain) == (header.producer_name, header.domain)
    assert meta.custom_metadata_map == header.props


def test_the_session_carries_the_metadata_and_fakes_have_none(tmp_path: Path) -> None:
    session = _load(tmp_path, classifier())
    assert session.metadata is not None and session.metadata["producer"] == "skl2onnx"
    assert session_metadata(session) == session.metadata
    assert session_metadata(FakeSession([], [])) is not None
    assert session_metadata(object()) is None


def test_the_header_is_found_past_a_large_graph_and_spelled_domains(tmp_path: Path) -> None:
    weights = helper.make_tensor(
        "w", TensorProto.FLOAT, [1 << 20], np.ones(1 << 20, np.float32).tobytes(), raw=True
    )
    model = _model(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1 << 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1 << 20])],
        opsets={"ai.onnx": 13, "com.microsoft": 1},
        props={"k": "v"},
        producer_name="pytorch",
        model_version=-3,
    )
    model.graph.initializer.append(weights)
    path = tmp_path / "big.onnx"
    onnx.save(model, str(path))
    assert path.stat().st_size > 4 << 20
    header = read_header(path)
    assert header is not None and header.complete
    assert header.opset == 13 and header.opsets["com.microsoft"] == 1
    assert header.model_version == -3 and header.props == {"k": "v"}
    assert "opset_ml" not in header.metadata()


def test_props_are_bounded_in_count_and_length() -> None:
    props = {f"key{i:02d}" + "k" * 300: "v" * 1000 for i in range(MAX_PROPS + 8)}
    model = _model([], [], [], props=props)
    header = parse_header(model.SerializeToString())
    assert header is not None
    assert len(header.props) == MAX_PROPS and header.props_total == MAX_PROPS + 8
    assert all(len(k) == MAX_TEXT and len(v) == MAX_TEXT for k, v in header.props.items())
    assert header.metadata()["props_omitted"] == 8


def test_truncated_files_give_what_was_read_and_never_raise() -> None:
    data = classifier().SerializeToString()
    seen_partial = False
    for cut in range(len(data)):
        header = parse_header(data[:cut])
        if cut <= 2:
            assert header is None or header.producer_name == ""
        if header is not None and not header.complete:
            seen_partial = True
            assert header.ir_version == 8  # the first field, read before the cut
    assert seen_partial
    last = parse_header(data[:-1])
    assert last is not None and not last.complete and last.producer_name == "skl2onnx"


def test_garbage_never_raises_and_is_bounded(tmp_path: Path) -> None:
    rng = random.Random(24)
    for _ in range(2000):
        parse_header(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200))))
    assert parse_header(b"\xff" * 64) is None  # a varint that never ends
    assert parse_header(b"\x00\x01") is None  # field 0
    assert parse_header(b"\x0b\x0c") is None  # a group
    assert parse_header(b"\x12\xff\xff\xff\xff\x0f ab") is None  # a length past the end
    many = parse_header(b"\x08\x01" * 200_000)  # ir_version, again and again
    assert many is not None and many.ir_version == 1 and not many.complete
    assert read_header(tmp_path / "missing.onnx") is None
    (tmp_path / "empty.onnx").write_bytes(b"")
    assert read_header(tmp_path / "empty.onnx") is None
    assert read_header(tmp_path) is None


def test_loading_a_model_imports_no_onnx(tmp_path: Path) -> None:
    path = tmp_path / "clf.onnx"
    onnx.save(classifier(), str(path))
    code = (
        "import sys\n"
        "from agent.models.backends.base import BackendOptions\n"
        "from agent.models.backends.onnxruntime import OnnxRuntimeBackend\n"
        f"s = OnnxRuntimeBackend().load({str(path)!r}, BackendOptions())\n"
        "print(s.metadata['producer'], 'onnx' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.split() == ["skl2onnx", "False"], result.stderr


# --------------------------------------------------------------------------- the inventory


def _record(name: str, session: Any, *, warmup: str | None = "ok") -> ModelRecord:
    loaded = LoadedVersion(name, 1, session, ModelConfig(), "onnxruntime")
    entry = VersionRecord("ready", "onnxruntime", loaded=loaded, warmup=warmup)
    failed = VersionRecord("failed", "onnxruntime", error="cannot load")
    return ModelRecord(name, serving=loaded, versions={1: entry, 2: failed})


def test_the_inventory_lists_signature_metadata_and_warmup(tmp_path: Path) -> None:
    inventory = inventory_of({"clf": _record("clf", _load(tmp_path, classifier()))})
    entry = inventory["models"]["clf"]["versions"]["1"]
    assert entry["warmup"] == "ok" and entry["providers"] == ["CPUExecutionProvider"]
    assert entry["signature"] == {
        "inputs": {
            "probs": {"type": "tensor(float)", "shape": ["?", 3]},
            "names": {"type": "tensor(string)", "shape": ["N"]},
        },
        "outputs": {
            "probabilities": {"type": ZIPMAP, "shape": []},
            "label": {"type": "tensor(string)", "shape": ["N"]},
            "scores": {"type": "tensor(float)", "shape": ["?", 3]},
        },
    }
    assert entry["metadata"] == {
        "producer": "skl2onnx",
        "producer_version": "1.16.0",
        "domain": "ai.onnx",
        "opset": 17,
        "opset_ml": 3,
        "props": {"author": "tests", "classes": "0,1,2"},
    }
    assert list(entry["signature"]["inputs"]) == ["probs", "names"]  # the model's order
    failed = inventory["models"]["clf"]["versions"]["2"]
    assert failed == {"state": "failed", "backend": "onnxruntime", "error": "cannot load"}
    assert cbor2.loads(encode_payload(inventory)) == inventory


def test_a_session_without_metadata_gets_a_signature_only() -> None:
    session = FakeSession(decoder_specs(3, "past_key_values"), decoder_specs(1, "present"))
    session.metadata = None  # type: ignore[assignment]
    entry = inventory_of({"m": _record("m", session, warmup=None)})["models"]["m"]["versions"]["1"]
    assert "metadata" not in entry and "warmup" not in entry
    assert entry["signature"]["inputs"]["past_key_values.0.key"] == {
        "type": "tensor(float)",
        "shape": ["batch_size", 12, "past_sequence_length", 64],
    }


def test_fifty_models_of_a_hundred_inputs_fit_the_message_limit() -> None:
    size, inputs_left, outputs_left = inventory_size(50, 100)
    assert size < 128 * 1024
    assert 0 < inputs_left < 50 * 100 and outputs_left == 50 * 100  # cut, inputs first
    assert inventory_size(1, 10) == (inventory_size(1, 10, uncut=True)[0], 0, 0)


def test_a_cut_signature_keeps_the_models_order_and_counts_the_rest() -> None:
    inputs = decoder_specs(100, "past_key_values")
    session = FakeSession(inputs, decoder_specs(100, "present"))
    records = {f"m{i}": _record(f"m{i}", session) for i in range(50)}
    signature = inventory_of(records)["models"]["m7"]["versions"]["1"]["signature"]
    listed = list(signature["inputs"])
    assert listed == [spec.name for spec in inputs[: len(listed)]]
    assert signature["omitted"] == {"inputs": 100 - len(listed), "outputs": 100}
    metadata = inventory_of(records)["models"]["m7"]["versions"]["1"]["metadata"]
    assert metadata["props"] == {} and metadata["props_omitted"] == 2


def test_the_manager_publishes_the_signature_of_what_it_loaded(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "clf" / "1"
    folder.mkdir(parents=True)
    onnx.save(classifier(), str(folder / "model.onnx"))
    manager = ModelManager(tmp_path / "models", BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        entry = manager.inventory()["models"]["clf"]["versions"]["1"]
        assert entry["state"] == "ready", entry
        assert entry["signature"]["outputs"]["probabilities"]["type"] == ZIPMAP
        assert entry["metadata"]["producer"] == "skl2onnx"
    finally:
        manager.close()


# --------------------------------------------------------------------------- the CLI


def test_the_cli_prints_the_inventory_for_a_person(tmp_path: Path) -> None:
    session = FakeSession(decoder_specs(100, "past_key_values"), decoder_specs(2, "present"))
    session.metadata = {**session.metadata, "props": {"note": "a\x1b[31mred"}}
    records = {f"m{i}": _record(f"m{i}", session) for i in range(50)}
    records["clf"] = _record("clf", _load(tmp_path, classifier()))
    text = format_inventory(inventory_of(records))
    lines = text.splitlines()
    assert "clf  serving v1" in lines
    assert "  v1  ready  onnxruntime  warmup ok  providers CPUExecutionProvider" in lines
    assert "  v2  failed  onnxruntime" in lines and "    error: cannot load" in lines
    assert "      probabilities  seq(map(int64,tensor(float)))  []" in lines
    assert "      scores         tensor(float)                  [?, 3]" in lines
    assert (
        "    metadata: producer skl2onnx 1.16.0, domain ai.onnx, opset 17, ai.onnx.ml opset 3"
        in lines
    )
    assert "      author = tests" in lines
    assert any(
        line.split(maxsplit=2)
        == ["past_key_values.0.key", "tensor(float)", "[batch_size, 12, past_sequence_length, 64]"]
        for line in lines
    )
    assert any(line.startswith("      ... ") and "left out" in line for line in lines)
    assert "\x1b" not in text
    assert format_inventory({"models": {}}) == "(no models)"


def test_the_models_command_chooses_json_or_text() -> None:
    parse = build_parser().parse_args
    assert parse(["models"]).json is None  # JSON when piped, text on a terminal
    assert parse(["models", "--json"]).json is True
    assert parse(["models", "--text"]).json is False
    with pytest.raises(SystemExit):
        parse(["models", "--json", "--text"])
