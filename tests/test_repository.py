"""Scanning model repositories built in tmp_path: every layout rule, checksums, config errors."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from agent.models.model_config import ModelConfig
from agent.models.repository import (
    file_fingerprint,
    parse_checksum,
    scan_repository,
    verify_checksum,
)
from tests.models_helpers import MODEL_BYTES, put

DIGEST = hashlib.sha256(MODEL_BYTES).hexdigest()


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


def test_a_number_too_long_and_a_missing_pin_are_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 19-digit folder is told why it is ignored (not "positive integers like 1, 2, 10"),
    and a pin of a version that is not there is said once (it was silent)."""
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "1234567890123456789" / "model.onnx")
    put(tmp_path / "m" / "config.toml", '[policy]\nversion_policy = "pinned"\npinned = 77\n')
    with caplog.at_level(logging.WARNING):
        scan_repository(tmp_path)
        scan_repository(tmp_path)
    said = warnings(caplog)
    assert len(said) == 2
    assert any("version numbers have 1 to 18 digits" in w for w in said)
    assert any("pinned = 77, but there is no version folder 77" in w for w in said)


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
    put(tmp_path / "m" / "config.toml", 'backend = "onnxruntime"\n')
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "2" / "model.engine")
    versions = scan_repository(tmp_path)["m"].versions
    assert versions[1].problem is None and versions[1].backend == "onnxruntime"
    assert (
        versions[2].problem
        == "config says backend 'onnxruntime', but model.engine is a tensorrt file"
    )


def test_onnx_under_tensorrt_is_built_by_the_agent(tmp_path: Path) -> None:
    put(tmp_path / "m" / "config.toml", 'backend = "tensorrt"\n')
    put(tmp_path / "m" / "1" / "model.onnx")
    put(tmp_path / "m" / "2" / "model.engine")
    versions = scan_repository(tmp_path)["m"].versions
    assert versions[1].problem is None and versions[1].backend == "tensorrt"
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


# --------------------------------------------------------------------------- config errors


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
