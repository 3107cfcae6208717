"""A model's config.toml: every key, its defaults, and one-line errors naming file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.models.backends.base import BackendOptions
from agent.models.model_config import (
    ModelConfig,
    ModelConfigError,
    StreamConfig,
    load_model_config,
    parse_model_config,
)
from tests.models_helpers import FULL_CONFIG, STEPS_H, STOP, put


def test_full_config_parses(tmp_path: Path) -> None:
    config = load_model_config(put(tmp_path / "config.toml", FULL_CONFIG))
    assert config.backend == "onnxruntime"
    s = config.stream
    assert (s.mode, s.max_steps, s.feed, s.state) == (
        "steps",
        64,
        {"token": "next_token"},
        {"h": "h_out"},
    )
    assert s.stop is not None and (s.stop.output, s.stop.value) == ("next_token", 0)
    assert s.emit == ["next_token"]
    assert config.inputs["token"].shape == ["batch", 1]
    assert (config.policy.version_policy, config.policy.pinned, config.policy.keep_loaded) == (
        "pinned",
        2,
        0,
    )
    options = config.backend_options.apply(BackendOptions())
    assert options == BackendOptions(intra_op_threads=2, providers=("CUDAExecutionProvider",))
    assert ModelConfig().backend_options.apply(BackendOptions()) == BackendOptions()


def test_defaults() -> None:
    config = parse_model_config("", "config.toml")
    assert config.backend is None
    assert (config.stream.mode, config.stream.micro_batch, config.stream.max_steps) == (
        "whole",
        1,
        32,
    )
    assert config.stream.stop is None and config.stream.emit is None
    assert (config.policy.version_policy, config.policy.keep_loaded) == ("latest", 1)


def test_emitted_defaults_to_all_but_state_outputs() -> None:
    steps = StreamConfig(mode="steps", state={"h": "h_out"})
    assert steps.emitted(["next_token", "logits", "h_out"]) == ["next_token", "logits"]
    assert StreamConfig(emit=["y"]).emitted(["y", "z"]) == ["y"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("colour = 'red'\n", "colour: unknown key"),
        ("[stream]\nmicro_batc = 4\n", "stream.micro_batc: unknown key"),
        (
            "[stream]\nstop = { output = 'y', value = 0, when = 1 }\n",
            "stream.stop.when: unknown key",
        ),
        ("backend = 'torch'\n", "backend: Input should be 'onnxruntime' or 'tensorrt'"),
        ("[stream]\nmode = 'stream'\n", "stream.mode: Input should be"),
        (
            "[stream]\nmicro_batch = 0\n",
            "stream.micro_batch: Input should be greater than or equal to 1",
        ),
        ("[stream]\nmicro_batch = '4'\n", "stream.micro_batch: Input should be a valid integer"),
        ("[stream]\nmicro_batch = 2.0\n", "stream.micro_batch: Input should be a valid integer"),
        (
            "[stream]\nmax_steps = 100001\n",
            "stream.max_steps: Input should be less than or equal to 100000",
        ),
        ("[stream]\nmode = 'steps'\n", 'stream: mode = "steps" needs feed or state'),
        (
            "[stream]\nfeed = { token = 'next_token' }\n",
            'stream: feed only apply to mode = "steps"',
        ),
        (
            "[stream]\nmode = 'batch'\nstate = { h = 'h_out' }\n" + STOP.format("'y'", 1),
            'stream: state, stop only apply to mode = "steps"',
        ),
        (
            "[stream]\nmode = 'steps'\nfeed = { h = 'a' }\nstate = { h = 'b' }\n",
            "stream: input(s) h set by both feed and state",
        ),
        (
            "[stream]\nfeed = { token = 3 }\nmode = 'steps'\n",
            "stream.feed.token: Input should be a valid string",
        ),
        (
            STEPS_H + STOP.format("'y'", "'end'"),
            "stream.stop.value: must be a number",
        ),
        (
            STEPS_H + STOP.format("'y'", "true"),
            "stream.stop.value: must be a number",
        ),
        ("[stream]\nemit = []\n", "stream.emit: must name at least one output"),
        ("[stream]\nemit = ['y', 'y']\n", "stream.emit: names an output twice"),
        ("[inputs.x]\ndtype = 'float'\nshape = [1]\n", "inputs.x.dtype: unknown dtype 'float'"),
        (
            "[inputs.x]\ndtype = 'float32'\nshape = [-1]\n",
            "inputs.x.shape: dims are sizes >= 0 or names",
        ),
        ("[inputs.x]\nshape = [1]\n", "inputs.x.dtype: Field required"),
        ("[policy]\nversion_policy = 'pinned'\n", 'policy: version_policy = "pinned" needs pinned'),
        ("[policy]\npinned = 3\n", 'policy: pinned is set but version_policy is "latest"'),
        (
            "[policy]\nkeep_loaded = -1\n",
            "policy.keep_loaded: Input should be greater than or equal to 0",
        ),
        ("[backend_options]\nthreads = 2\n", "backend_options.threads: unknown key"),
        ("[stream\nmode = 'whole'\n", "invalid TOML: "),
    ],
)
def test_config_errors_are_one_line_naming_file_and_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = put(tmp_path / "m" / "config.toml", text)
    with pytest.raises(ModelConfigError) as info:
        load_model_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_several_config_errors_in_one_line(tmp_path: Path) -> None:
    path = put(tmp_path / "config.toml", "[stream]\nmicro_batch = 0\nmax_steps = 0\nextra = 1\n")
    with pytest.raises(ModelConfigError) as info:
        load_model_config(path)
    message = str(info.value)
    assert "\n" not in message
    for key in ["stream.micro_batch", "stream.max_steps", "stream.extra: unknown key"]:
        assert key in message


def test_unreadable_configs(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_model_config(tmp_path / "absent.toml")
    with pytest.raises(ModelConfigError, match="not UTF-8"):
        load_model_config(put(tmp_path / "latin1.toml", b"# caf\xe9\n"))
    with pytest.raises(ModelConfigError, match="more than 65536"):
        load_model_config(put(tmp_path / "big.toml", "#" * 70_000))
