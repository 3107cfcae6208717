"""Warm-up: plausible synthetic inputs, a valid model served cold when they do not fit, and
an explicit `[warmup]` that fails the version when it fails."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from agent.models.backends.base import BackendOptions, TensorSpec
from agent.models.manager import ModelManager
from agent.models.model_config import ModelConfigError, WarmupConfig, parse_model_config
from agent.models.warmup import IMAGE_SIDE, WARMUP_OFF, WARMUP_OK, synthetic_inputs


class _Specs:
    """Just enough of a Session for the synthetic guesses: its inputs."""

    def __init__(self, *specs: TensorSpec) -> None:
        self.inputs = specs


def _spec(name: str, dtype: str, *shape: Any) -> TensorSpec:
    return TensorSpec(name, np.dtype(dtype), tuple(shape))


def _shapes(*specs: TensorSpec) -> dict[str, tuple[tuple[int, ...], Any]]:
    feed = synthetic_inputs(_Specs(*specs))  # type: ignore[arg-type]
    return {name: (arr.shape, arr.reshape(-1)[:1].tolist()) for name, arr in feed.items()}


def test_decoder_with_past_gets_consistent_lengths() -> None:
    shapes = _shapes(
        _spec("input_ids", "int64", "batch_size", "sequence_length"),
        _spec("attention_mask", "int64", "batch_size", "past_sequence_length + sequence_length"),
        _spec("past_key_values.0.key", "float32", "batch_size", 2, "past_sequence_length", 8),
        _spec("position_ids", "int64", "batch_size", "sequence_length"),
    )
    seq = shapes["input_ids"][0][1]
    past = shapes["past_key_values.0.key"][0][2]
    assert seq > 0 and past > 0
    assert shapes["attention_mask"] == ((1, past + seq), [1])  # a mask of ones, not zeros
    assert shapes["input_ids"] == ((1, seq), [0])


def test_images_get_a_side_that_survives_pooling() -> None:
    shapes = _shapes(
        _spec("x", "float32", "batch", 3, "height", "width"),
        _spec("nhwc", "uint8", None, None, None, 3),
    )
    assert shapes["x"][0] == (1, 3, IMAGE_SIDE, IMAGE_SIDE)
    assert shapes["nhwc"][0] == (1, IMAGE_SIDE, IMAGE_SIDE, 3)
    assert IMAGE_SIDE % 32 == 0


def test_audio_models_get_a_sample_rate_and_a_window() -> None:
    shapes = _shapes(
        _spec("input", "float32", None, None),
        _spec("state", "float32", 2, None, 128),
        _spec("sr", "int64"),
    )
    assert shapes["sr"] == ((), [16000])
    assert shapes["input"][0][0] == 1 and shapes["input"][0][1] >= 256
    assert shapes["state"][0][0] == 2 and shapes["state"][0][2] == 128


def test_speech_samples_get_a_window_not_a_token_count() -> None:
    """wav2vec2-style `input_values [batch, sequence_length]` (optimum's names): a window of
    samples its convolutions take, not the 4 a text's sequence gets; a spectrogram's
    `input_values` (rank 3) is no such thing."""
    shapes = _shapes(_spec("input_values", "float32", "batch_size", "sequence_length"))
    assert shapes["input_values"][0][0] == 1 and shapes["input_values"][0][1] >= 256
    spectrogram = _shapes(_spec("input_values", "float32", "batch_size", "frames", 128))
    assert spectrogram["input_values"][0][1] < 256


def test_other_scalars_are_one_and_strings_are_text() -> None:
    shapes = _shapes(_spec("k", "int64"), _spec("text", "object", None, 1))
    assert shapes["k"] == ((), [1])
    assert shapes["text"] == ((1, 1), ["a"])


# ----------------------------------------------------------------------- through the manager


def _reshape_model() -> bytes:
    """Valid, but only for inputs of 6 elements: x[n] reshaped to [2, 3]. A synthetic guess
    (n = 1) cannot know that; a real request can."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 3])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "reshape6",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def _repo(root: Path, config: str, npz: dict[str, np.ndarray] | None = None) -> Path:
    version = root / "reshape6" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(_reshape_model())
    (root / "reshape6" / "config.toml").write_text(config)
    if npz is not None:
        np.savez(version / "warmup.npz", **npz)  # type: ignore[arg-type]
    return root


def _version(root: Path, *, warmup: bool = True) -> dict[str, Any]:
    manager = ModelManager(root, BackendOptions(), settle_s=0.0, warmup=warmup)
    try:
        manager.sync()
        entry: dict[str, Any] = manager.inventory()["models"]["reshape6"]["versions"]["1"]
        if entry["state"] == "ready":
            with manager.lease("reshape6") as lease:
                out = lease.session.run({"x": np.arange(6, dtype=np.float32)})
                assert out["y"].shape == (2, 3)
        return entry
    finally:
        manager.close()


def test_a_failed_guess_serves_the_version_cold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.models.warmup"):
        entry = _version(_repo(tmp_path, ""))
    assert entry["state"] == "ready"
    assert entry["warmup"].startswith("skipped: ") and "reshape" in entry["warmup"].lower()
    warnings = [r for r in caplog.records if "serving it cold" in r.getMessage()]
    assert len(warnings) == 1


def test_explicit_inputs_warm_it_up(tmp_path: Path) -> None:
    entry = _version(_repo(tmp_path, "[warmup]\ninputs = { x = { shape = [6], value = 0.5 } }\n"))
    assert entry["state"] == "ready" and entry["warmup"] == WARMUP_OK


def test_an_npz_file_warms_it_up(tmp_path: Path) -> None:
    root = _repo(tmp_path, "[warmup]\nfile = 'warmup.npz'\n", {"x": np.ones(6, np.float32)})
    entry = _version(root)
    assert entry["state"] == "ready" and entry["warmup"] == WARMUP_OK


def test_a_broken_explicit_warmup_fails_the_version(tmp_path: Path) -> None:
    entry = _version(_repo(tmp_path, "[warmup]\ninputs = { x = { shape = [5] } }\n"))
    assert entry["state"] == "failed"
    assert "warm-up ([warmup] inputs) failed" in entry["error"]
    assert "warmup" not in entry or entry["warmup"] is None


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("[warmup]\ninputs = { nope = { shape = [6] } }\n", "nope"),
        ("[warmup]\nfile = 'missing.npz'\n", "missing.npz"),
    ],
)
def test_explicit_warmup_naming_the_wrong_things_fails(
    tmp_path: Path, config: str, needle: str
) -> None:
    entry = _version(_repo(tmp_path, config))
    assert entry["state"] == "failed" and needle in entry["error"]


def test_warmup_off_for_the_agent_or_the_model(tmp_path: Path) -> None:
    assert _version(_repo(tmp_path / "a", ""), warmup=False)["warmup"] == WARMUP_OFF
    entry = _version(_repo(tmp_path / "b", "[warmup]\nenabled = false\n"))
    assert entry["state"] == "ready" and entry["warmup"] == WARMUP_OFF


@pytest.mark.parametrize(
    "text",
    [
        "[warmup]\nfile = '../x.npz'\n",
        "[warmup]\ninputs = { x = { shape = [-1] } }\n",
        "[warmup]\ninputs = { x = { shape = [100000, 100000] } }\n",
        "[warmup]\nbogus = 1\n",
    ],
)
def test_warmup_section_is_checked(text: str) -> None:
    with pytest.raises(ModelConfigError, match="warmup"):
        parse_model_config(text, "config.toml")


def test_warmup_defaults() -> None:
    assert not WarmupConfig().explicit and WarmupConfig().enabled
    assert onnx.checker.check_model(onnx.load_from_string(_reshape_model())) is None


def _summing_model() -> bytes:
    """x[n] -> y[2, 3], any n: the same signature as `_reshape_model`, and a guess fits it."""
    zeros = helper.make_tensor("zeros", TensorProto.FLOAT, [2, 3], [0.0] * 6)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1),
            helper.make_node("Add", ["zeros", "s"], ["y"]),
        ],
        "summing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [zeros],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def test_a_failed_guess_does_not_replace_a_version_that_warmed_up(tmp_path: Path) -> None:
    root = _repo(tmp_path, "")
    (root / "reshape6" / "1" / "model.onnx").write_bytes(_summing_model())
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        model = manager.inventory()["models"]["reshape6"]
        assert model["serving"] == 1 and model["versions"]["1"]["warmup"] == WARMUP_OK
        (root / "reshape6" / "2").mkdir()
        (root / "reshape6" / "2" / "model.onnx").write_bytes(_reshape_model())
        manager.sync()  # seen, then settled and loaded
        manager.sync()
        model = manager.inventory()["models"]["reshape6"]
        assert model["serving"] == 1
        failed = model["versions"]["2"]
        assert failed["state"] == "failed"
        assert "v1 keeps serving" in failed["error"] and "[warmup]" in failed["error"]
        with manager.lease("reshape6") as lease:
            assert lease.loaded.version == 1
    finally:
        manager.close()
