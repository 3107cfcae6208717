"""Scanning model repositories built in tmp_path: every layout rule, checksums, config errors."""

from __future__ import annotations

import hashlib
import logging
import os
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
from agent.models.repository import (
    ModelConfig,
    ModelConfigError,
    StreamConfig,
    check_signature,
    file_fingerprint,
    load_model_config,
    parse_checksum,
    parse_model_config,
    scan_repository,
    verify_checksum,
)

MODEL_BYTES = b"\x08\x08 not really onnx, the scanner never parses it"
DIGEST = hashlib.sha256(MODEL_BYTES).hexdigest()


def put(path: Path, content: bytes | str = MODEL_BYTES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    return path


def problem(root: Path, model: str, version: int) -> str | None:
    return scan_repository(root)[model].versions[version].problem


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- layout


def test_empty_and_missing_roots(tmp_path: Path) -> None:
    assert scan_repository(tmp_path) == {}
    with pytest.raises(FileNotFoundError):
        scan_repository(tmp_path / "absent")
    with pytest.raises(NotADirectoryError):
        scan_repository(put(tmp_path / "file"))


def test_a_plain_onnx_model_needs_no_config(tmp_path: Path) -> None:
    put(tmp_path / "mlp" / "1" / "model.onnx")
    put(tmp_path / "README.md", "files beside the models are ignored")
    repo = scan_repository(tmp_path)
    assert list(repo) == ["mlp"]
    model = repo["mlp"]
    assert model.config == ModelConfig() and model.config_error is None
    assert model.path == tmp_path.resolve() / "mlp"
    v = model.versions[1]
    assert (v.model, v.version, v.backend, v.sha256_expected, v.problem) == (
        "mlp",
        1,
        "onnxruntime",
        None,
        None,
    )
    assert v.path == model.path / "1" and v.model_file == v.path / "model.onnx" and v.ok


def test_model_names(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ["ok-name_1.2", "A" * 64, "bad name", "B" * 65, "émoji", "semi;colon"]:
        put(tmp_path / name / "1" / "model.onnx")
    for name in [".hidden", "upload.tmp", "copy.partial"]:
        put(tmp_path / name / "1" / "model.onnx")
    with caplog.at_level(logging.WARNING):
        assert sorted(scan_repository(tmp_path)) == ["A" * 64, "ok-name_1.2"]
        first = warnings(caplog)
        scan_repository(tmp_path)
    assert len(first) == 4 and all("skipped" in w for w in first)
    assert warnings(caplog) == first  # once per entry, not once per scan
    assert not any(n in w for w in first for n in (".hidden", "upload.tmp", "copy.partial"))


def test_version_folders(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ["1", "2", "10", "01", "0", "-1", "latest", "3.tmp", "4.partial", ".5"]:
        put(tmp_path / "m" / name / "model.onnx")
    put(tmp_path / "m" / "notes.txt", "ignored")
    with caplog.at_level(logging.WARNING):
        versions = scan_repository(tmp_path)["m"].versions
    assert list(versions) == [1, 2, 10]
    ignored = warnings(caplog)
    assert len(ignored) == 4
    assert all(any(w.split(":")[0].endswith(f"/{n}") for w in ignored) for n in ["01", "0", "-1"])


def test_a_version_name_that_is_a_file_is_a_problem(tmp_path: Path) -> None:
    put(tmp_path / "m" / "1")
    assert problem(tmp_path, "m", 1) == "not a folder"


def test_a_model_without_versions_is_listed(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    assert scan_repository(tmp_path)["m"].versions == {}


@pytest.mark.parametrize(
    ("files", "backend", "expected"),
    [
        (["model.onnx"], "onnxruntime", None),
        (["model.plan"], "tensorrt", None),
        (["model.engine"], "tensorrt", None),
        ([], None, "no model file"),
        (["model.onnx.tmp", "weights.bin"], None, "no model file"),
        (["model.onnx", "model.plan"], None, "several model files: model.onnx, model.plan"),
    ],
)
def test_exactly_one_model_file(
    tmp_path: Path, files: list[str], backend: str | None, expected: str | None
) -> None:
    folder = tmp_path / "m" / "1"
    folder.mkdir(parents=True)
    for name in files:
        put(folder / name)
    v = scan_repository(tmp_path)["m"].versions[1]
    assert v.backend == backend
    if expected is None:
        assert v.problem is None
    else:
        assert v.problem is not None and v.problem.startswith(expected)


def test_an_empty_model_file_is_a_problem(tmp_path: Path) -> None:
    put(tmp_path / "m" / "1" / "model.onnx", b"")
    assert problem(tmp_path, "m", 1) == "model.onnx is empty"


def test_model_file_that_is_a_folder_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "m" / "1" / "model.onnx").mkdir(parents=True)
    assert problem(tmp_path, "m", 1) == "model.onnx is not a regular file"


def test_config_backend_must_fit_the_file(tmp_path: Path) -> None:
    put(tmp_path / "m" / "config.toml", 'backend = "tensorrt"\n')
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "2" / "model.engine")
    versions = scan_repository(tmp_path)["m"].versions
    assert (
        versions[1].problem
        == "config says backend 'tensorrt', but model.onnx is a onnxruntime file"
    )
    assert versions[2].problem is None and versions[2].backend == "tensorrt"


# --------------------------------------------------------------------------- symlinks


def test_links_inside_the_root_are_followed(tmp_path: Path) -> None:
    put(tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "alias").symlink_to(tmp_path / "m")
    (tmp_path / "m" / "2").symlink_to(tmp_path / "m" / "1")
    (tmp_path / "m" / "3").mkdir()
    (tmp_path / "m" / "3" / "model.onnx").symlink_to(tmp_path / "m" / "1" / "model.onnx")
    repo = scan_repository(tmp_path)
    assert sorted(repo) == ["alias", "m"]
    assert [v.problem for v in repo["m"].versions.values()] == [None, None, None]


def test_a_linked_root_is_resolved(tmp_path: Path) -> None:
    put(tmp_path / "real" / "m" / "1" / "model.onnx")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert problem(tmp_path / "link", "m", 1) is None


def test_links_out_of_the_root_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "models", tmp_path / "elsewhere"
    put(outside / "x" / "1" / "model.onnx")
    put(outside / "model.onnx")
    put(outside / "model.sha256", DIGEST)
    root.mkdir()
    (root / "escaped").symlink_to(outside / "x")
    (root / "m").mkdir()
    (root / "m" / "1").symlink_to(outside / "x" / "1")
    (root / "m" / "2").mkdir()
    (root / "m" / "2" / "model.onnx").symlink_to(outside / "model.onnx")
    put(root / "m" / "3" / "model.onnx")
    (root / "m" / "3" / "model.sha256").symlink_to(outside / "model.sha256")
    with caplog.at_level(logging.WARNING):
        repo = scan_repository(root)
    assert list(repo) == ["m"]
    assert any("escaped: skipped, it resolves outside" in w for w in warnings(caplog))
    versions = repo["m"].versions
    assert versions[1].problem == "the version folder resolves outside the repository"
    assert versions[2].problem == "model.onnx resolves outside the repository"
    assert versions[3].problem == "model.sha256 resolves outside the repository"


def test_a_broken_link_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.plan").symlink_to(tmp_path / "gone.plan")
    v = scan_repository(tmp_path)["m"].versions[1]
    assert v.problem == "model.plan is a broken symbolic link"
    assert v.backend == "tensorrt"


# --------------------------------------------------------------------------- checksums


@pytest.mark.parametrize(
    "content",
    [
        f"{DIGEST}\n",
        f"{DIGEST}",
        f"{DIGEST}  model.onnx\n",
        f"{DIGEST} *model.onnx\n",
        f"{DIGEST.upper()}  ./model.onnx\n",
        f"# made by sha256sum\n{'0' * 64}  other.bin\n{DIGEST}  model.onnx\n",
    ],
)
def test_checksum_formats_that_match(tmp_path: Path, content: str) -> None:
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "1" / "model.sha256", content)
    v = scan_repository(tmp_path)["m"].versions[1]
    assert v.problem is None and v.sha256_expected == DIGEST
    assert verify_checksum(v) is None


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("", "model.sha256 is empty"),
        ("\n# only a comment\n", "model.sha256 is empty"),
        ("abc123  model.onnx\n", "model.sha256 is not a sha256 digest"),
        (f"{DIGEST}0\n", "model.sha256 is not a sha256 digest"),
        (f"{DIGEST}  model.plan\n", "model.sha256 has no digest for model.onnx"),
        (f"{DIGEST}\n{'1' * 64}\n", "model.sha256 has several digests for model.onnx"),
        (b"\xff\xfe", "model.sha256 is not a sha256 digest (not ASCII text)"),
        ("a" * 5000, "model.sha256 is larger than 4096 bytes"),
    ],
)
def test_bad_checksum_files_are_problems(
    tmp_path: Path, content: str | bytes, expected: str
) -> None:
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "1" / "model.sha256", content)
    found = problem(tmp_path, "m", 1)
    assert found is not None and found.startswith(expected)


def test_checksum_mismatch(tmp_path: Path) -> None:
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "1" / "model.sha256", f"{'ab' * 32}  model.onnx\n")
    v = scan_repository(tmp_path)["m"].versions[1]
    assert v.problem is None  # the scan only reads the digest; hashing is verify_checksum's
    assert verify_checksum(v) == (
        f"checksum mismatch for model.onnx: expected {'ab' * 32}, got {DIGEST}"
    )


def test_checksum_of_a_big_file_and_of_a_vanished_one(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # spans several 1 MiB blocks
    put(tmp_path / "m" / "1" / "model.plan", data)
    put(tmp_path / "m" / "1" / "model.sha256", hashlib.sha256(data).hexdigest())
    v = scan_repository(tmp_path)["m"].versions[1]
    assert verify_checksum(v) is None
    assert v.model_file is not None
    v.model_file.unlink()
    found = verify_checksum(v)
    assert found is not None and found.startswith("cannot read model.plan")


def test_no_checksum_means_nothing_to_verify(tmp_path: Path) -> None:
    put(tmp_path / "m" / "1" / "model.onnx")
    assert verify_checksum(scan_repository(tmp_path)["m"].versions[1]) is None


def test_parse_checksum_directly() -> None:
    assert parse_checksum(f"{DIGEST}  sub/model.onnx", "model.onnx") == DIGEST
    with pytest.raises(ValueError, match="no digest"):
        parse_checksum(f"{DIGEST}  model.onnxx", "model.onnx")


def test_file_fingerprint_tracks_size_and_mtime(tmp_path: Path) -> None:
    path = put(tmp_path / "model.onnx", b"1234")
    before = file_fingerprint(path)
    assert before[0] == 4
    os.utime(path, ns=(before[1] + 1_000_000, before[1] + 1_000_000))
    assert file_fingerprint(path) == (4, before[1] + 1_000_000)
    put(path, b"12345")
    assert file_fingerprint(path)[0] == 5


def test_scanning_writes_nothing(tmp_path: Path) -> None:
    put(tmp_path / "m" / "config.toml", "[stream]\nmode = 'batch'\n")
    put(tmp_path / "m" / "1" / "model.onnx")
    before = sorted((p, file_fingerprint(p)) for p in tmp_path.rglob("*") if p.is_file())
    scan_repository(tmp_path)
    after = sorted((p, file_fingerprint(p)) for p in tmp_path.rglob("*") if p.is_file())
    assert before == after


# --------------------------------------------------------------------------- config.toml


STEPS_H = "[stream]\nmode = 'steps'\nstate = { h = 'h_out' }\n"
STOP = "stop = {{ output = {}, value = {} }}\n"

FULL_CONFIG = """
backend = "onnxruntime"
[stream]
mode = "steps"
max_steps = 64
feed = { token = "next_token" }
state = { h = "h_out" }
stop = { output = "next_token", value = 0 }
emit = ["next_token"]
[inputs.token]
dtype = "int64"
shape = ["batch", 1]
[outputs.logits]
dtype = "float32"
shape = ["batch", 32]
[policy]
version_policy = "pinned"
pinned = 2
keep_loaded = 0
[backend_options]
intra_op_threads = 2
providers = ["CUDAExecutionProvider"]
"""


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


def test_a_broken_config_is_reported_and_the_versions_still_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    put(tmp_path / "m" / "config.toml", "[stream]\nmode = 'fast'\n")
    put(tmp_path / "m" / "1" / "model.onnx")
    with caplog.at_level(logging.WARNING):
        model = scan_repository(tmp_path)["m"]
        scan_repository(tmp_path)
    assert model.config is None
    assert model.config_error is not None
    assert model.config_error.startswith(f"{tmp_path.resolve() / 'm' / 'config.toml'}: stream.mode")
    assert list(model.versions) == [1] and model.versions[1].backend == "onnxruntime"
    assert len([w for w in warnings(caplog) if "not served" in w]) == 1


def test_config_that_is_a_folder_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "m" / "config.toml").mkdir(parents=True)
    model = scan_repository(tmp_path)["m"]
    assert model.config is None and model.config_error is not None
    assert "cannot read" in model.config_error


# --------------------------------------------------------------------------- signature


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
