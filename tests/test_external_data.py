"""External tensor data: only files inside the version folder are read, whatever ONNX Runtime's
own checks are (agent.models.backends.external_data.external_data_problem)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.models.backends.base import BackendOptions, ModelLoadError
from agent.models.backends.external_data import external_data_problem
from agent.models.backends.onnxruntime import OnnxRuntimeBackend

CPU = BackendOptions(providers=("CPUExecutionProvider",), intra_op_threads=1)
WEIGHTS = np.arange(4, dtype=np.float32).reshape(1, 4)


def add_model(external: str | None = None) -> onnx.ModelProto:
    """y = x + W, x and W float [1, 4]; W stored in the file `external` if given."""
    w = numpy_helper.from_array(WEIGHTS, "W")
    if external is not None:
        w.ClearField("raw_data")
        w.data_location = TensorProto.EXTERNAL
        for key, value in (("location", external), ("offset", "0"), ("length", "16")):
            w.external_data.add(key=key, value=value)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def nested_model(external: str) -> onnx.ModelProto:
    """An If whose then-branch holds an external constant tensor (a subgraph's tensor)."""
    w = numpy_helper.from_array(WEIGHTS, "W")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=external)
    then = helper.make_graph(
        [helper.make_node("Constant", [], ["t"], value=w)],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        "nested",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def write_version(folder: Path, model: onnx.ModelProto, weights: str = "weights.bin") -> Path:
    """`folder/model.onnx`, and the weights (16 bytes) at `folder/weights` if inside it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    target = folder / weights
    if not Path(weights).is_absolute() and ".." not in Path(weights).parts:
        target.write_bytes(WEIGHTS.tobytes())
    return path


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file just outside the version folders, the same size as the weights."""
    path = tmp_path / "models" / "ext" / "secret.bin"
    path.parent.mkdir(parents=True)
    path.write_bytes(np.full((1, 4), 7, np.float32).tobytes())
    return path


def test_external_data_inside_the_version_folder_loads_and_answers(tmp_path: Path):
    path = write_version(tmp_path / "1", add_model("weights.bin"))
    assert external_data_problem(path) is None
    session = OnnxRuntimeBackend().load(path, CPU)
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["y"], x + WEIGHTS)


def test_external_data_in_a_subfolder_is_fine(tmp_path: Path):
    (tmp_path / "1" / "data").mkdir(parents=True)
    path = write_version(tmp_path / "1", add_model("data/weights.bin"), "data/weights.bin")
    assert external_data_problem(path) is None


@pytest.mark.parametrize(
    ("location", "says"),
    [
        pytest.param("../secret.bin", "leaves the version folder", id="dotdot"),
        pytest.param("data/../../secret.bin", "leaves the version folder", id="inner-dotdot"),
        pytest.param("..\\secret.bin", "leaves the version folder", id="backslash-dotdot"),
        pytest.param("/etc/passwd", "absolute path", id="absolute"),
        pytest.param("C:\\secret.bin", "absolute path", id="windows-absolute"),
    ],
)
def test_location_outside_the_version_folder_is_refused(
    tmp_path: Path, secret: Path, location: str, says: str
):
    path = write_version(secret.parent / "1", add_model(location), location)
    assert says in (external_data_problem(path) or "")
    with pytest.raises(ModelLoadError) as info:
        OnnxRuntimeBackend().load(path, CPU)
    assert repr(location) in str(info.value) and says in str(info.value)


def test_a_link_out_of_the_version_folder_is_refused(tmp_path: Path, secret: Path):
    path = write_version(secret.parent / "1", add_model("weights.bin"), "unused.bin")
    (path.parent / "weights.bin").symlink_to(secret)
    problem = external_data_problem(path)
    assert problem is not None and "resolves outside the version folder" in problem


def test_a_missing_or_short_data_file_is_named(tmp_path: Path):
    """As when a user copies model.onnx without model.onnx.data, or before its copy ends:
    said plainly, before ONNX Runtime's own message."""
    path = write_version(tmp_path / "1", add_model("weights.bin"))
    (path.parent / "weights.bin").unlink()
    problem = external_data_problem(path)
    assert problem == (
        "tensor 'W': external data 'weights.bin' is not in the version folder: copy it beside "
        "the model file"
    )
    with pytest.raises(ModelLoadError, match="copy it beside the model file"):
        OnnxRuntimeBackend().load(path, CPU)
    (path.parent / "weights.bin").write_bytes(WEIGHTS.tobytes()[:10])
    problem = external_data_problem(path)
    assert problem is not None and "is 10 bytes, the tensor ends at byte 16" in problem


def test_tensors_of_subgraphs_are_checked(tmp_path: Path):
    path = write_version(tmp_path / "1", nested_model("/etc/passwd"), "/etc/passwd")
    problem = external_data_problem(path)
    assert problem is not None and "'/etc/passwd'" in problem and "absolute" in problem


def test_unparsable_file_is_refused(tmp_path: Path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\xff" * 100)
    with pytest.raises(ModelLoadError, match="cannot load"):
        OnnxRuntimeBackend().load(path, CPU)


def wait_for_state(agent, model: str, version: str, timeout: float = 30.0) -> dict:
    """The inventory entry of `model`/`version` once it is ready or failed."""
    deadline = time.monotonic() + timeout
    entry: dict = {}
    while time.monotonic() < deadline:
        versions = agent.models.inventory()["models"].get(model, {}).get("versions", {})
        entry = versions.get(version, {})
        if entry.get("state") in ("ready", "failed"):
            return entry
        time.sleep(0.05)
    return entry


def test_the_agent_marks_such_a_version_failed_and_serves_the_good_one(
    broker, make_agent, make_client, tmp_path: Path
):
    root = tmp_path / "models"
    write_version(root / "good" / "1", add_model("weights.bin"))
    (root / "bad").mkdir()
    (root / "bad" / "secret.bin").write_bytes(WEIGHTS.tobytes())
    write_version(root / "bad" / "1", add_model("../secret.bin"), "../secret.bin")
    write_version(root / "abs" / "1", add_model("/etc/passwd"), "/etc/passwd")
    agent = make_agent(broker, root)

    bad = wait_for_state(agent, "bad", "1")
    assert bad.get("state") == "failed"
    assert "'../secret.bin'" in bad["error"] and "leaves the version folder" in bad["error"]
    absolute = wait_for_state(agent, "abs", "1")
    assert absolute.get("state") == "failed" and "'/etc/passwd'" in absolute["error"]

    assert wait_for_state(agent, "good", "1").get("state") == "ready"
    client = make_client(broker, agent)
    x = np.ones((1, 4), np.float32)
    outputs = client.request("good", {"x": x}, stream=False).collect()
    np.testing.assert_array_equal(outputs["y"], x + WEIGHTS)
