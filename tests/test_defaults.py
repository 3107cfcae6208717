"""`[defaults]`: an input's value when a request leaves it out. Checked against the model's
signature at load (a misfit fails the version with one line), used when omitted, overridden
when sent, used by the synthetic warm-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from agent.client import AgentClient
from agent.demo.broker import EmbeddedBroker
from agent.inference.runner import required_inputs
from agent.models.backends.base import BackendOptions, TensorSpec
from agent.models.backends.registry import get_backend
from agent.models.defaults import default_arrays, default_problems, with_defaults
from agent.models.model_config import ModelConfigError, parse_model_config
from agent.models.warmup import synthetic_inputs
from agent.service.agent import Agent

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
SPECS = [
    TensorSpec("x", F32, ("n", 2)),
    TensorSpec("bias", F32, (2,)),
    TensorSpec("sr", I64, ()),
    TensorSpec("on", np.dtype(bool), ()),
    TensorSpec("word", np.dtype(object), ("k",), "tensor(string)"),
    TensorSpec("rows", F32, ("n", 2)),
]


@pytest.mark.parametrize(
    ("defaults", "problem"),
    [
        ({"nope": 1}, "[defaults] nope: not a model input"),
        ({"sr": 16000.5}, "[defaults] sr: 16000.5 does not fit the input's type int64"),
        ({"sr": "16000"}, "[defaults] sr: '16000' does not fit the input's type int64"),
        ({"sr": True}, "[defaults] sr: True does not fit"),
        ({"bias": True}, "[defaults] bias: True does not fit the input's type float32"),
        ({"bias": "a"}, "does not fit the input's type float32"),
        ({"bias": [1.0, 2.0, 3.0]}, "[defaults] bias: an array of shape [3] does not fit"),
        ({"bias": [[1.0, 2.0]]}, "an array of shape [1, 2] does not fit"),
        ({"on": 1}, "[defaults] on: 1 does not fit the input's type bool"),
        ({"word": 3}, "does not fit the input's type string"),
        ({"sr": 1 << 70}, "does not fit the input's type int64"),
    ],
)
def test_a_default_that_does_not_fit_is_one_clear_line(
    defaults: dict[str, Any], problem: str
) -> None:
    problems = default_problems(defaults, SPECS)
    assert len(problems) == 1 and problem in problems[0], problems


def test_defaults_that_fit_become_the_inputs_tensors() -> None:
    defaults = {"bias": [0.0, 1], "sr": 16000, "on": True, "word": ["a", "b"], "rows": 0.5}
    assert default_problems(defaults, SPECS) == []
    arrays = default_arrays(defaults, SPECS)
    assert arrays["bias"].dtype == F32 and arrays["bias"].tolist() == [0.0, 1.0]
    assert arrays["sr"].dtype == I64 and arrays["sr"].shape == () and int(arrays["sr"]) == 16000
    assert arrays["on"].dtype == bool and bool(arrays["on"])
    assert arrays["word"].tolist() == ["a", "b"]
    assert arrays["rows"].shape == (1, 2)  # a scalar fills the shape; symbolic dims are 1
    assert not arrays["sr"].flags.writeable  # shared by every request
    given = {"x": np.zeros((1, 2), F32), "sr": np.array(8000, I64)}
    full = with_defaults(given, arrays)
    assert int(full["sr"]) == 8000  # the request's own value wins
    assert full["bias"] is arrays["bias"]


def test_defaulted_inputs_are_not_required() -> None:
    names = [s.name for s in required_inputs(SPECS, ("sr", "bias"), {"x": 0})]
    assert "sr" not in names and "bias" not in names and "x" in names
    names = [s.name for s in required_inputs(SPECS, ("sr",), {"sr": 0})]
    assert "sr" in names  # sent: checked like any input


@pytest.mark.parametrize(
    "text",
    [
        "[defaults]\nsr = { a = 1 }\n",
        "[defaults]\nb = [[1, 2], [3]]\n",
        "[defaults]\nb = [1, 'a']\n",
    ],
)
def test_defaults_that_are_not_values_are_config_errors(text: str) -> None:
    with pytest.raises(ModelConfigError, match="defaults"):
        parse_model_config(text, "config.toml")


# -- through an agent ----------------------------------------------------------------------


def add_model(path: Path) -> None:
    """y = x + bias, z = x * scale: `bias` float [2], `scale` int64 scalar."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "bias"], ["y"]),
            helper.make_node("Cast", ["scale"], ["s"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x", "s"], ["z"]),
        ],
        "add",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("scale", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


CONFIGS = {
    "add": "[defaults]\nbias = [0.0, 1.0]\nscale = 3\n",
    "bad_type": "[defaults]\nscale = 2.5\n",
    "bad_shape": "[defaults]\nbias = [1.0, 2.0, 3.0]\n",
    "bad_name": "[defaults]\nscales = 2\n",
}


@pytest.fixture(scope="module")
def defaults_agent(
    broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Agent, AgentClient]]:
    from tests.conftest import agent_config

    tmp = tmp_path_factory.mktemp("defaults")
    root = tmp / "models"
    for name, text in CONFIGS.items():
        add_model(root / name / "1" / "model.onnx")
        (root / name / "config.toml").write_text(text)
    agent = Agent(agent_config(tmp, broker, root))
    agent.start()
    client = AgentClient(broker.host, broker.port, device_id=agent.config.device_id).connect()
    try:
        agent.wait_ready(10)
        yield agent, client
    finally:
        client.close()
        agent.stop()


def entry(agent: Agent, name: str) -> dict[str, Any]:
    found: dict[str, Any] = agent.models.inventory()["models"][name]["versions"]["1"]
    return found


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("bad_type", "[defaults] scale: 2.5 does not fit the input's type int64"),
        ("bad_shape", "[defaults] bias: an array of shape [3] does not fit bias: float32[2]"),
        ("bad_name", "[defaults] scales: not a model input (it has x, bias, scale)"),
    ],
)
def test_a_misfit_default_fails_the_version(
    defaults_agent: tuple[Agent, AgentClient], name: str, error: str
) -> None:
    agent, _ = defaults_agent
    found = entry(agent, name)
    assert found["state"] == "failed"
    assert error in found["error"]


def test_defaults_are_used_when_left_out_and_overridden_when_sent(
    defaults_agent: tuple[Agent, AgentClient],
) -> None:
    agent, client = defaults_agent
    assert entry(agent, "add")["state"] == "ready"
    assert entry(agent, "add")["warmup"] == "ok"
    x = np.array([[1.0, 2.0]], np.float32)
    got = client.request("add", {"x": x}, stream=False).collect()
    assert got["y"].tolist() == [[1.0, 3.0]] and got["z"].tolist() == [[3.0, 6.0]]
    sent = {"x": x, "bias": np.array([10.0, 20.0], np.float32), "scale": np.array(2, np.int64)}
    got = client.request("add", sent, stream=False).collect()
    assert got["y"].tolist() == [[11.0, 22.0]] and got["z"].tolist() == [[2.0, 4.0]]
    chunks = list(client.request("add", {"x": x}, stream=True))
    assert chunks[0].outputs["y"].tolist() == [[1.0, 3.0]]


def test_the_synthetic_warm_up_uses_the_defaults(tmp_path: Path) -> None:
    add_model(tmp_path / "model.onnx")
    session = get_backend("onnxruntime").load(tmp_path / "model.onnx", BackendOptions())
    known = default_arrays({"scale": 7}, session.inputs)
    inputs = synthetic_inputs(session, known)
    assert int(inputs["scale"]) == 7 and inputs["bias"].shape == (2,)
    session.close()
