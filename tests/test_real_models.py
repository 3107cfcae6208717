"""Models made by real exporters, dropped into a models folder with an empty `config.toml`,
as a user brings them: each loads, says how its warm-up went and what it takes, and answers
as its own framework did.

The fixtures come from `scripts/make_real_models.py` (optimum, the silero-vad wheel,
torch.onnx, skl2onnx) and `scripts/make_paddle_models.py` (Paddle2ONNX), each with the
framework's reference outputs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient, AgentError
from agent.demo.broker import EmbeddedBroker
from agent.service.agent import Agent

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real"
FAMILIES = (
    "gpt2",
    "silero_vad",
    "ocr_det",
    "paddle_det",
    "paddle_rec",
    "sklearn_iris",
    "sklearn_strings",
    "sklearn_text",
)
# What the synthetic warm-up makes of each (`ok` where its guesses fit the model).
WARMUP = {name: "ok" for name in FAMILIES}


def reference(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    meta = json.loads((FIXTURES / name / "reference.json").read_text())
    with np.load(FIXTURES / name / "reference.npz", allow_pickle=False) as data:
        inputs = {k[3:]: data[k] for k in data.files if k.startswith("in.")}
        outputs = {k[4:]: data[k] for k in data.files if k.startswith("out.")}
    return meta, inputs, outputs


def wire_inputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """numpy unicode arrays as the object arrays of `str` a string tensor decodes to."""
    return {k: v.astype(object) if v.dtype.kind == "U" else v for k, v in inputs.items()}


@pytest.fixture(scope="module")
def real_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("real")
    root = tmp / "models"
    for name in FAMILIES:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.toml").write_text("")
        shutil.copy(FIXTURES / name / "model.onnx", root / name / "1" / "model.onnx")
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def version_entry(agent: Agent, name: str) -> dict[str, Any]:
    entry: dict[str, Any] = agent.models.inventory()["models"][name]["versions"]["1"]
    return entry


@pytest.mark.parametrize("name", FAMILIES)
def test_loads_with_an_empty_config(real_agent: tuple[Agent, AgentClient], name: str) -> None:
    agent, _ = real_agent
    entry = version_entry(agent, name)
    assert entry["state"] == "ready", entry.get("error")
    assert entry["warmup"] == WARMUP[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_signature_and_metadata_in_the_inventory(
    real_agent: tuple[Agent, AgentClient], name: str
) -> None:
    agent, _ = real_agent
    meta, _, _ = reference(name)
    entry = version_entry(agent, name)
    expected = meta["signature"]
    if isinstance(expected, str):  # the script wrote a long signature as its repr
        pytest.skip("reference signature not stored as JSON")
    for role in ("inputs", "outputs"):
        listed = entry["signature"][role]
        assert list(listed) == [item["name"] for item in expected[role]]
        for item in expected[role]:
            shape = [("?" if d is None else d) for d in item["shape"]]
            assert listed[item["name"]] == {"type": item["type"], "shape": shape}
    metadata = entry["metadata"]
    assert metadata["producer"] == meta["onnx"]["producer_name"]
    assert metadata["producer_version"] == meta["onnx"]["producer_version"]
    opsets = meta["onnx"]["opset_import"]
    assert metadata["opset"] == opsets.get("ai.onnx", opsets.get(""))


def close(actual: Any, expected: np.ndarray, meta: dict[str, Any]) -> None:
    tolerance = meta["tolerance"]
    if expected.dtype.kind == "U":
        assert list(np.asarray(actual).ravel()) == list(expected.ravel())
    else:
        np.testing.assert_allclose(actual, expected, rtol=tolerance["rtol"], atol=tolerance["atol"])


@pytest.mark.parametrize("name", FAMILIES)
def test_answers_as_its_framework_did(real_agent: tuple[Agent, AgentClient], name: str) -> None:
    _, client = real_agent
    meta, inputs, outputs = reference(name)
    got = client.request(name, wire_inputs(inputs), stream=False).collect()
    for key, expected in outputs.items():
        close(got[key], expected, meta)
    for key, expected_maps in meta["json_outputs"].items():
        key_type = meta["json_output_key_types"][key]
        cast: Callable[[str], Any] = int if key_type == "int64" else str
        assert isinstance(got[key], list) and len(got[key]) == len(expected_maps)
        for got_map, want in zip(got[key], expected_maps, strict=True):
            assert set(got_map) == {cast(k) for k in want}
            for k, v in want.items():
                assert got_map[cast(k)] == pytest.approx(v, rel=1e-4, abs=1e-5)


def test_string_labels_and_zipmap_stream_in_a_chunk(real_agent: tuple[Agent, AgentClient]) -> None:
    _, client = real_agent
    _, inputs, outputs = reference("sklearn_strings")
    chunks = list(client.request("sklearn_strings", inputs))
    assert len(chunks) == 1
    labels = chunks[0].outputs["output_label"]
    assert labels.dtype == object and list(labels) == list(outputs["output_label"])
    assert all(isinstance(m, dict) and all(isinstance(k, str) for k in m) for m in
               chunks[0].outputs["output_probability"])  # fmt: skip


def test_params_outputs_narrows_what_is_sent(real_agent: tuple[Agent, AgentClient]) -> None:
    _, client = real_agent
    meta, inputs, outputs = reference("gpt2")
    got = client.request("gpt2", inputs, stream=False, params={"outputs": ["logits"]}).collect()
    assert list(got) == ["logits"]
    close(got["logits"], outputs["logits"], meta)
    with pytest.raises(AgentError, match=r"bad_request.*nope"):
        client.request("gpt2", inputs, params={"outputs": ["nope"]}).collect()


def test_a_string_input_refuses_numbers(real_agent: tuple[Agent, AgentClient]) -> None:
    _, client = real_agent
    with pytest.raises(AgentError, match=r"bad_request.*string"):
        client.request("sklearn_text", {"input": np.zeros((1, 1), np.float32)}).collect()


@pytest.fixture(scope="module")
def ocr_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    """The Paddle recogniser with `[[postprocess]] op = "ctc"`, as its ctc.json says, also
    with the `[preprocess]` of its lines.json (and without the op), and the Paddle ink-map
    detector with `[preprocess]` and `op = "db"`, as its db.json says."""
    from tests.conftest import agent_config, serve_agent

    tmp = tmp_path_factory.mktemp("ocr")
    root = tmp / "models"
    decoded = json.loads((FIXTURES / "paddle_rec" / "ctc.json").read_text())
    (root / "rec" / "1").mkdir(parents=True)
    for file in ("model.onnx", decoded["labels"]):
        shutil.copy(FIXTURES / "paddle_rec" / file, root / "rec" / "1" / file)
    (root / "rec" / "config.toml").write_text(
        f'[[postprocess]]\noutput = "fetch_name_0"\nop = "ctc"\nlabels = "{decoded["labels"]}"\n'
        f"space = {str(decoded['space']).lower()}\n"
    )
    lines = json.loads((FIXTURES / "paddle_rec" / "lines.json").read_text())
    line_preprocess = "[preprocess]\n" + "".join(
        f"{key} = {json.dumps(value)}\n" for key, value in lines["preprocess"].items()
    )
    for name, post in (("rec_lines", True), ("rec_lines_raw", False)):
        (root / name / "1").mkdir(parents=True)
        for file in ("model.onnx", decoded["labels"]):
            shutil.copy(FIXTURES / "paddle_rec" / file, root / name / "1" / file)
        ctc = (root / "rec" / "config.toml").read_text() if post else ""
        (root / name / "config.toml").write_text(line_preprocess + "\n" + ctc)
    found = json.loads((FIXTURES / "paddle_db" / "db.json").read_text())
    pre, db = found["preprocess"], found["db"]
    (root / "det" / "1").mkdir(parents=True)
    shutil.copy(FIXTURES / "paddle_db" / "model.onnx", root / "det" / "1" / "model.onnx")
    (root / "det" / "config.toml").write_text(
        f'[preprocess]\nresize = {pre["resize"]}\ncolor = "{pre["color"]}"\nscale = "1/255"\n'
        f'mean = {pre["mean"]}\nstd = {pre["std"]}\n\n[[postprocess]]\noutput = "fetch_name_0"\n'
        f'op = "db"\n' + "".join(f"{key} = {value}\n" for key, value in db.items())
    )
    yield from serve_agent(broker, agent_config(tmp, broker, root))


def test_a_recognisers_text_is_paddleocrs(ocr_agent: tuple[Agent, AgentClient]) -> None:
    """The `ctc` op gives the texts and scores of PaddleX's own CTC decoder (what PaddleOCR
    decodes with) of the same probabilities, in place of them."""
    _, client = ocr_agent
    _, inputs, _ = reference("paddle_rec")
    decoded = json.loads((FIXTURES / "paddle_rec" / "ctc.json").read_text())
    got = client.request("rec", inputs, stream=False).collect()
    assert set(got) == {"fetch_name_0_text", "fetch_name_0_score"}
    assert got["fetch_name_0_text"].tolist() == decoded["texts"]
    np.testing.assert_allclose(got["fetch_name_0_score"], decoded["scores"], rtol=1e-5)
    assert " " in "".join(decoded["texts"])  # the space class was met


@pytest.mark.parametrize("line", [0, 1])
def test_a_text_line_crop_is_prepared_as_paddleocr_prepares_it(
    ocr_agent: tuple[Agent, AgentClient], line: int
) -> None:
    """A crop sent as PNG bytes, `resize_mode = "fit_height"`: 32 rows, its width kept to its
    aspect on a canvas at least 320 wide, zeros on the right (PaddleX's
    `OCRReisizeNormImg`). The model's probabilities, every padded step included, are those
    of PaddleX's pipeline, and so is the text the `ctc` op reads from them."""
    _, client = ocr_agent
    lines = json.loads((FIXTURES / "paddle_rec" / "lines.json").read_text())
    want = lines["lines"][line]
    crop = (FIXTURES / "paddle_rec" / want["image"]).read_bytes()
    reply = client.request("rec_lines_raw", {"x": crop}, stream=False)
    got = reply.collect()["fetch_name_0"]
    with np.load(FIXTURES / "paddle_rec" / "lines.npz") as probabilities:
        np.testing.assert_allclose(got, probabilities[want["image"]], rtol=1e-4, atol=1e-5)
    assert reply.geometry is not None and reply.geometry["input"] == want["input"]
    assert reply.geometry["pad"] == [0, 0]
    text = client.request("rec_lines", {"x": crop}, stream=False).collect()
    assert text["fetch_name_0_text"].tolist() == [want["text"]]
    np.testing.assert_allclose(text["fetch_name_0_score"], [want["score"]], atol=1e-6)


def test_a_detectors_text_boxes_are_paddleocrs(ocr_agent: tuple[Agent, AgentClient]) -> None:
    """The `db` op on a page sent as PNG bytes: PaddleX's own DBPostProcess boxes (quads in
    the page's pixels; a pixel apart at most where pyclipper's integer polygon rounds a
    slanted corner otherwise) and scores, the speck included, in PaddleOCR's order."""
    _, client = ocr_agent
    found = json.loads((FIXTURES / "paddle_db" / "db.json").read_text())
    page = (FIXTURES / "paddle_db" / found["image"]).read_bytes()
    got = client.request("det", {"x": page}, stream=False).collect()
    assert set(got) == {"boxes", "scores"}
    want = np.array(found["boxes"], dtype=np.int32)
    assert got["boxes"].dtype == np.int32 and got["boxes"].shape == want.shape == (4, 4, 2)
    assert np.abs(got["boxes"] - want).max() <= 1
    np.testing.assert_allclose(got["scores"], found["scores"], rtol=1e-5)
