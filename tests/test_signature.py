"""Whether a loaded model fits its config.toml: declared tensors, feed/state links, modes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.demo import models as demo_models
from agent.models.backends.base import BackendOptions, TensorSpec
from agent.models.backends.onnxruntime import OnnxRuntimeBackend
from agent.models.model_config import ModelConfig, parse_model_config
from agent.models.signature import check_signature, request_inputs
from tests.models_helpers import FULL_CONFIG, STEPS_H, STOP


@dataclass
class FakeSession:
    """Just enough of a Session for check_signature."""

    inputs: Sequence[TensorSpec]
    outputs: Sequence[TensorSpec]
    providers: Sequence[str] = field(default_factory=lambda: ("Fake",))

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def spec(name: str, dtype: str, *shape: int | str | None) -> TensorSpec:
    return TensorSpec(name, np.dtype(dtype), tuple(shape))


DECODER = FakeSession(
    inputs=[spec("token", "int64", "batch", 1), spec("h", "float32", "batch", 32)],
    outputs=[
        spec("next_token", "int64", "batch", 1),
        spec("logits", "float32", "batch", 32),
        spec("h_out", "float32", "batch", 32),
    ],
)


def test_a_fitting_config_has_no_signature_problems(tmp_path: Path) -> None:
    config = parse_model_config(FULL_CONFIG, "config.toml")
    assert check_signature(config, DECODER) == []
    real = OnnxRuntimeBackend().load(
        demo_models.save(demo_models.gru_decoder(), tmp_path / "model.onnx"), BackendOptions()
    )
    assert check_signature(config, real) == []
    assert check_signature(ModelConfig(), real) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[inputs.tok]\ndtype = 'int64'\nshape = [1]\n",
            "declared input 'tok' is not in the model (it has token, h)",
        ),
        (
            "[inputs.token]\ndtype = 'int32'\nshape = ['b', 1]\n",
            "input 'token': declared int32, model has int64",
        ),
        (
            "[inputs.token]\ndtype = 'int64'\nshape = [1]\n",
            "input 'token': declared rank 1, model has token: int64[?,1]",
        ),
        (
            "[outputs.logits]\ndtype = 'float32'\nshape = [1, 16]\n",
            "output 'logits': dim 1 declared 16, model has 32",
        ),
        (
            "[stream]\nmode = 'steps'\nfeed = { tok = 'next_token' }\n",
            "feed input 'tok' is not a model input",
        ),
        (
            "[stream]\nmode = 'steps'\nfeed = { token = 'next' }\n",
            "feed output 'next' is not a model output",
        ),
        (
            "[stream]\nmode = 'steps'\nfeed = { token = 'logits' }\n",
            "feed token <- logits: int64 input, float32 output",
        ),
        ("[stream]\nmode = 'steps'\nstate = { h = 'logits' }\n", None),
        (
            STEPS_H + STOP.format("'eos'", 1),
            "stop output 'eos' is not a model output",
        ),
        ("[stream]\nemit = ['next_token', 'probs']\n", "emit output 'probs' is not a model output"),
    ],
)
def test_signature_problems(text: str, expected: str | None) -> None:
    problems = check_signature(parse_model_config(text, "config.toml"), DECODER)
    if expected is None:
        assert problems == []  # h <- logits: same dtype and shape, so it fits
    else:
        assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_state_shapes_must_agree() -> None:
    session = FakeSession(
        inputs=[spec("h", "float32", "batch", 32)], outputs=[spec("h_out", "float32", "batch", 16)]
    )
    config = parse_model_config("[stream]\nmode='steps'\nstate = { h = 'h_out' }\n", "c.toml")
    assert check_signature(config, session) == [
        "state h <- h_out: shapes differ (h: float32[?,32]; h_out: float32[?,16])"
    ]


def test_batch_mode_needs_a_leading_axis() -> None:
    session = FakeSession(inputs=[spec("scale", "float32")], outputs=[spec("y", "float32", 4)])
    config = parse_model_config("[stream]\nmode = 'batch'\nmicro_batch = 2\n", "c.toml")
    assert check_signature(config, session) == [
        "batch mode slices the leading axis, but input 'scale' is a scalar"
    ]


def test_a_scan_request_carries_a_recording_of_any_length_along_the_windows_axis() -> None:
    """A model that fixes its window's size there still takes a whole recording; its other
    inputs, and every input of another mode, are checked as the model declares them."""
    inputs = [spec("input", "float32", "batch", 576), spec("state", "float32", 2, "batch", 32)]
    scan = parse_model_config(
        "[stream]\nmode = 'scan'\nstate = { state = 'state_out' }\n"
        "[scan]\ninput = 'input'\nwindow = 576\nhop = 512\n",
        "c.toml",
    )
    assert [s.shape for s in request_inputs(inputs, scan)] == [
        ("batch", "recording"),
        (2, "batch", 32),
    ]
    assert request_inputs(inputs, parse_model_config("", "c.toml")) == tuple(inputs)
