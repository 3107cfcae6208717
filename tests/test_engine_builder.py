"""Building engines on the box: cache, atomic publishing, profiles, progress, the CLI.

Runs against the tensorrt/pycuda test doubles (tests/fakes); see test_tensorrt_backend.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.demo import models as demo_models
from agent.models import engine_builder
from agent.models.backends.base import BackendOptions
from agent.models.backends.tensorrt import TensorRTBackend
from agent.models.engine_builder import (
    BuildOptions,
    EngineBuildError,
    ShapeRange,
    build_engine,
    main,
    parse_profile,
)
from agent.models.engine_builder.publish import sha256_file
from agent.models.repository import scan_repository, verify_checksum
from tests import fakes
from tests.fakes import FakeGPU, install, uninstall

fake_gpu = fakes.fake_gpu  # the fixture: fresh fakes in sys.modules per test


@pytest.fixture
def onnx_file(tmp_path: Path) -> Path:
    """An MLP as version 1 of models/mlp (dynamic batch)."""
    return demo_models.save(demo_models.mlp(), tmp_path / "models" / "mlp" / "1" / "model.onnx")


def options(tmp_path: Path, lines: list[str] | None = None, **kwargs: Any) -> BuildOptions:
    sink = lines.append if lines is not None else (lambda line: None)
    return BuildOptions(cache_dir=tmp_path / "cache", progress=sink, **kwargs)


def versions(model_dir: Path) -> list[str]:
    return sorted((p.name for p in model_dir.iterdir() if not p.name.startswith(".")), key=str)


# --------------------------------------------------------------------------- publishing


def test_build_adds_a_complete_version_the_repository_serves(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    plan = build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path))
    assert plan == tmp_path / "models" / "mlp" / "2" / "model.plan"
    assert sorted(p.name for p in plan.parent.iterdir()) == [
        "build.json",
        "model.plan",
        "model.sha256",
    ]
    info = json.loads((plan.parent / "build.json").read_text())
    assert info["tensorrt"] == "10.3.0" and info["gpu"] == {
        "name": "Orin (fake)",
        "compute_capability": [8, 7],
    }
    assert info["onnx_sha256"] == sha256_file(onnx_file)
    scanned = scan_repository(tmp_path / "models")["mlp"].versions
    assert scanned[2].backend == "tensorrt" and scanned[2].ok
    assert scanned[2].sha256_expected is not None and verify_checksum(scanned[2]) is None
    assert not [p for p in plan.parent.parent.iterdir() if p.name.endswith(".tmp")]


def test_second_build_is_a_cache_hit(fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path) -> None:
    model_dir = onnx_file.parent.parent
    first = build_engine(onnx_file, model_dir, options(tmp_path))
    lines: list[str] = []
    second = build_engine(onnx_file, model_dir, options(tmp_path, lines))
    assert second == first and fake_gpu.builds == 1
    assert versions(model_dir) == ["1", "2"]  # no new version for the same build
    assert any("already built" in line for line in lines)
    # Another repository on the same box: published from the engine cache, not rebuilt.
    other = tmp_path / "elsewhere" / "mlp"
    lines.clear()
    copied = build_engine(onnx_file, other, options(tmp_path, lines))
    assert copied == other / "1" / "model.plan" and fake_gpu.builds == 1
    assert copied.read_bytes() == first.read_bytes()
    assert any("cache hit" in line for line in lines)


def test_a_reboot_does_not_rebuild(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, onnx_file: Path
) -> None:
    install(monkeypatch)
    try:
        build_engine(onnx_file, tmp_path / "a", options(tmp_path))
    finally:
        uninstall()
    device = install(monkeypatch)  # a new process: fresh runtime, same GPU, same disk
    try:
        build_engine(onnx_file, tmp_path / "b", options(tmp_path))
        assert device.builds == 0
    finally:
        uninstall()


def test_key_changes_with_options_tensorrt_and_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, onnx_file: Path
) -> None:
    model_dir = onnx_file.parent.parent
    device = install(monkeypatch)
    try:
        build_engine(onnx_file, model_dir, options(tmp_path))
        build_engine(onnx_file, model_dir, options(tmp_path, fp16=True))
        build_engine(onnx_file, model_dir, options(tmp_path, max_batch=4))
        assert device.builds == 3 and versions(model_dir) == ["1", "2", "3", "4"]
    finally:
        uninstall()
    for setup in (
        {"trt_version": "10.4.0"},
        {"compute_capability": (7, 2), "name": "Xavier (fake)"},
    ):
        device = install(monkeypatch, **setup)
        try:
            build_engine(onnx_file, model_dir, options(tmp_path))
            assert device.builds == 1, setup
        finally:
            uninstall()


def test_force_rebuilds_and_the_timing_cache_is_reused(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    model_dir = onnx_file.parent.parent
    build_engine(onnx_file, model_dir, options(tmp_path))
    timing = list((tmp_path / "cache").glob("timing-10.3.0-orin-fake-sm87.cache"))
    assert len(timing) == 1 and fake_gpu.timing_cache_misses > 0 and fake_gpu.timing_cache_hits == 0
    misses = fake_gpu.timing_cache_misses
    lines: list[str] = []
    build_engine(onnx_file, model_dir, options(tmp_path, lines, force=True))
    assert fake_gpu.builds == 2 and fake_gpu.timing_cache_hits == misses
    assert any("timing cache" in line and "loaded" in line for line in lines)
    assert versions(model_dir) == ["1", "2", "3"]


def test_a_corrupt_timing_cache_starts_empty(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    timing = tmp_path / "t.cache"
    timing.write_bytes(b"garbage")
    lines: list[str] = []
    build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path, lines, timing_cache=timing))
    assert any("not usable; starting empty" in line for line in lines)
    assert timing.read_bytes().startswith(b"FTRTTC1")


def test_publishing_is_atomic(fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path) -> None:
    model_dir = onnx_file.parent.parent

    def crash(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", crash)  # publish renames the finished version folder
        with pytest.raises(EngineBuildError, match="No space left"):
            build_engine(onnx_file, model_dir, options(tmp_path))
    assert sorted(p.name for p in model_dir.iterdir()) == [".build.lock", "1"]  # no half version
    # A version folder that appeared meanwhile (another tool) is never overwritten.
    (model_dir / "2").mkdir()
    (model_dir / "2" / "model.onnx").write_bytes(b"someone else's")
    plan = build_engine(onnx_file, model_dir, options(tmp_path))
    assert plan.parent.name == "3"
    assert (model_dir / "2" / "model.onnx").read_bytes() == b"someone else's"


def test_the_scanner_ignores_a_build_in_progress(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    model_dir = onnx_file.parent.parent
    in_progress = model_dir / ".build-0123456789ab-42.tmp"
    in_progress.mkdir()
    (in_progress / "model.plan").write_bytes(b"half")
    assert list(scan_repository(tmp_path / "models")["mlp"].versions) == [1]


def test_a_config_pinning_onnxruntime_is_warned_about(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (onnx_file.parent.parent / "config.toml").write_text('backend = "onnxruntime"\n')
    with caplog.at_level("WARNING", logger="agent.models.engine_builder"):
        build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path))
    assert any("marked failed" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- profiles


def test_parse_profile() -> None:
    assert parse_profile("x:1x16/4x16/8x16, input:0:1/2/3") == {
        "x": ShapeRange((1, 16), (4, 16), (8, 16)),
        "input:0": ShapeRange((1,), (2,), (3,)),
    }
    for bad, message in [
        ("x:1x16/8x16", "NAME:MIN/OPT/MAX"),
        ("x:1xa/2/3", "integers"),
        ("x:4/2/8", "min <= opt <= max"),
        ("x:1x2/1/1", "same rank"),
        ("x:1/1/1,x:1/1/1", "twice"),
        ("", "empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_profile(bad)


def test_explicit_profiles_reach_the_engine(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    profiles = (parse_profile("x:1x16/1x16/2x16"), parse_profile("x:3x16/8x16/32x16"))
    plan = build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path, profiles=profiles))
    session = TensorRTBackend().load(plan, BackendOptions())
    try:
        assert [p["x"] for p in session.profiles] == [
            ((1, 16), (1, 16), (2, 16)),
            ((3, 16), (8, 16), (32, 16)),
        ]
        assert session.run({"x": np.ones((32, 16), np.float32)})["y"].shape == (32, 8)
    finally:
        session.close()


def test_profile_problems_are_build_errors(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    model_dir = onnx_file.parent.parent
    for profile, message in [
        ({"z": ShapeRange((1,), (1,), (1,))}, "names 'z', not an input"),
        ({"x": ShapeRange((1, 17), (1, 17), (2, 17))}, "dim 1 is fixed at 16"),
        ({"x": ShapeRange((1,), (1,), (2,))}, "has rank 2"),
    ]:
        with pytest.raises(EngineBuildError, match=message):
            build_engine(onnx_file, model_dir, options(tmp_path, profiles=(profile,)))
    image = demo_models.save(demo_models.mlp(), tmp_path / "dyn" / "model.onnx")
    import onnx

    model = onnx.load(str(image))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "features"
    onnx.save(model, str(image))
    with pytest.raises(EngineBuildError, match="dynamic beyond the batch dim"):
        build_engine(image, tmp_path / "dynmodel", options(tmp_path))


def test_builder_failures_carry_the_loggers_message(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    with pytest.raises(EngineBuildError, match="Could not find any implementation"):
        build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path, workspace_bytes=1024))
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"\x08\x07garbage")
    with pytest.raises(EngineBuildError, match=r"ONNX parser: .*Failed to parse"):
        build_engine(broken, tmp_path / "b", options(tmp_path))
    assert versions(onnx_file.parent.parent) == ["1"]


# --------------------------------------------------------------------------- versions, progress


def test_progress_monitor_on_tensorrt_10(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    lines: list[str] = []
    build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path, lines))
    assert "Building engine (2 steps)" in lines
    assert any(line.startswith("  Tactic selection") for line in lines)
    assert any("Building engine done in" in line for line in lines)


@pytest.mark.parametrize("fake_gpu", ["8.6.1"], indirect=True)
def test_tensorrt_8_6_builds_explicit_batch_and_logs_phases(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    lines: list[str] = []
    plan = build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path, lines))
    assert any("no progress steps before TensorRT 10" in line for line in lines)
    session = TensorRTBackend().load(plan, BackendOptions())
    try:
        assert session.run({"x": np.zeros((2, 16), np.float32)})["y"].shape == (2, 8)
    finally:
        session.close()


def test_engine_matches_onnx_runtime_in_fp32_and_fp16(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path
) -> None:
    import onnxruntime as ort

    x = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    expected = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )[0]
    scale = float(np.max(np.abs(expected)))
    for fp16, tolerance in ((False, 1e-6), (True, 1e-2)):
        plan = build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path, fp16=fp16))
        session = TensorRTBackend().load(plan, BackendOptions())
        try:
            error = float(np.max(np.abs(session.run({"x": x})["y"] - expected))) / scale
            assert error < tolerance, (fp16, error)
        finally:
            session.close()


def test_missing_tensorrt_is_a_build_error_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, onnx_file: Path
) -> None:
    install(monkeypatch, tensorrt=False)
    try:
        with pytest.raises(EngineBuildError, match="python3-libnvinfer"):
            build_engine(onnx_file, onnx_file.parent.parent, options(tmp_path))
    finally:
        uninstall()


# --------------------------------------------------------------------------- CLI


def test_cli_builds_into_the_model_folder_of_the_onnx_file(
    fake_gpu: FakeGPU, tmp_path: Path, onnx_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        str(onnx_file),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--fp16",
        "--workspace-mib",
        "64",
    ]
    assert main([*argv, "--profile", "x:1x16/2x16/4x16", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "models" / "mlp" / "2" / "model.plan") and err == ""
    info = json.loads((tmp_path / "models" / "mlp" / "2" / "build.json").read_text())
    assert info["options"] == {
        "fp16": True,
        "int8": False,
        "workspace_bytes": 64 * 1024 * 1024,
        "max_batch": 8,
        "profiles": [{"x": "1x16/2x16/4x16"}],
    }
    assert main([*argv, "--profile", "x:1x16/2x16/4x16"]) == 0  # progress on stderr
    assert "already built" in capsys.readouterr().err


def test_cli_errors(fake_gpu: FakeGPU, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loose = demo_models.save(demo_models.mlp(), tmp_path / "loose.onnx")
    assert main([str(loose)]) == 2
    assert "--into MODEL_DIR" in capsys.readouterr().err
    assert main([str(loose), "--into", str(tmp_path / "m"), "--profile", "x:1"]) == 2
    assert "NAME:MIN/OPT/MAX" in capsys.readouterr().err
    cache = ["--cache-dir", str(tmp_path / "cache"), "-q"]
    assert main([str(loose), "--into", str(tmp_path / "m"), "--workspace-mib", "0", *cache]) == 2
    assert "workspace_bytes must be > 0" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.onnx"), "--into", str(tmp_path / "m"), *cache]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert engine_builder.default_cache_dir() == tmp_path / "edge-agent" / "engines"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert (
        engine_builder.default_cache_dir()
        == Path(os.path.expanduser("~")) / ".cache" / "edge-agent" / "engines"
    )


# --------------------------------------------------------------------------- scripts/gpu-check


REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_script_runs_on_the_fakes(
    fake_gpu: FakeGPU, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prepared GPU check itself, dry-run here so it is known to work when a GPU is lent."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look it up there
    spec.loader.exec_module(gpu_check)
    results = tmp_path / "results.json"
    argv = ["--swaps", "4", "--workdir", str(tmp_path / "w"), "--json", str(results)]
    assert gpu_check.main(argv) == 0
    checks = {c["name"]: c["status"] for c in json.loads(results.read_text())["checks"]}
    assert checks["compare mlp (FP32)"] == "PASS" and checks["4 engine swaps"] == "PASS"
    assert checks["TensorRT generate, cache in the session's device arrays"] == "PASS"
    assert checks["compare mlp (activation memory by run)"] == "PASS"
    assert checks["TensorRT generate, activation memory by run"] == "PASS"
    assert "FAIL" not in checks.values()
    assert fake_gpu.device_bytes == 0


def test_gpu_check_without_tensorrt_says_skipped_and_exits_0() -> None:
    import importlib.util
    import subprocess

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here: run scripts/gpu-check.sh itself")
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check.sh"), "--swaps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "tensorrt not importable: skipped" in done.stdout


def test_external_data_outside_the_version_folder_is_not_built(
    fake_gpu: FakeGPU, tmp_path: Path
) -> None:
    """The engine builder hands TensorRT's parser only files whose external data stays in
    the model's folder (the parser would read whatever `location` names)."""
    from tests.test_external_data import add_model, write_version

    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    model = write_version(tmp_path / "in" / "add" / "1", add_model("../../../secret.bin"))
    with pytest.raises(EngineBuildError, match="leaves the version folder"):
        build_engine(model, tmp_path / "out", options(tmp_path))
