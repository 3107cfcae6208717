"""ONNX Runtime's CPU memory arena given back after a large request (decision 0039): one run
in every `SHRINK_EVERY_S` asks ONNX Runtime to free the arena's unused chunks at its end.

Real ONNX Runtime, a real exported model (the Paddle OCR detector fixture, whose activations
grow with the image), the process's resident memory from /proc. What a run adds to it depends
on what the process freed before (a large request may reuse it and grow it less), so the
scenarios that measure it run in a fresh interpreter of their own (`in_fresh_process`).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from agent.models.backends import onnxruntime as ort_backend
from agent.models.backends.base import BackendOptions, InferenceError
from agent.models.backends.onnxruntime import OnnxRuntimeBackend, OnnxSession

REPO = Path(__file__).resolve().parent.parent
DETECTOR = REPO / "tests" / "fixtures" / "real" / "ocr_det" / "model.onnx"
SMALL = {"x": np.zeros((1, 3, 64, 64), np.float32)}
LARGE = {"x": np.zeros((4, 3, 960, 960), np.float32)}
MIB = 1024 * 1024


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def in_fresh_process(scenario: str, *args: str) -> dict[str, Any]:
    """What the scenario function `scenario` of this module returns, run with `args` in a new
    interpreter (its resident memory owes nothing to the tests before it)."""
    code = (
        "import json, sys\n"
        "from tests import test_ort_arena as t\n"
        f"print(json.dumps(t.{scenario}(*sys.argv[1:])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def grown_kept_left() -> dict[str, int]:
    """Scenario: one session with `SHRINK_EVERY_S` an hour: a large run, a small one, then a
    small one after the clock passed the shrink's turn; resident bytes over the first small
    run's after each."""
    ort_backend.SHRINK_EVERY_S = 3600.0
    session = OnnxRuntimeBackend().load(DETECTOR, BackendOptions(intra_op_threads=1))
    try:
        session.run(SMALL)
        before = rss()
        session.run(LARGE)
        grown = rss() - before
        session.run(SMALL)
        kept = rss() - before
        an_hour_later = time.monotonic() + 3601
        ort_backend.time = SimpleNamespace(monotonic=lambda: an_hour_later)
        session.run(SMALL)  # the shrink's turn
        return {"grown": grown, "kept": kept, "left": rss() - before}
    finally:
        session.close()


def test_a_large_requests_memory_goes_back_at_the_next_shrinking_run() -> None:
    """The arena keeps what a large request grew it to through the runs before the shrink's
    turn, and the first run after `SHRINK_EVERY_S` gives it back."""
    got = in_fresh_process("grown_kept_left")
    grown = got["grown"]
    assert grown > 32 * MIB and got["kept"] > 0.75 * grown, got
    assert got["left"] < 0.25 * grown, got


def test_an_onnxruntime_that_refuses_the_shrink_is_not_asked_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The shrink names an arena ONNX Runtime does not have (here `gpu:0` on the CPU): the run
    is made again without it and answers, one warning is logged, and later runs do not ask.
    A run that fails for its own reason still fails, once asked with and once without."""
    import onnxruntime as ort

    monkeypatch.setattr(ort_backend, "SHRINK_EVERY_S", 0.0)
    session = OnnxRuntimeBackend().load(DETECTOR, BackendOptions(intra_op_threads=1))
    try:
        refused = ort.RunOptions()
        refused.add_run_config_entry(ort_backend.SHRINK_KEY, "gpu:0")
        session._shrink = session._shrink_cpu = refused  # the CPU arena's own shrink refused
        with pytest.raises(InferenceError, match=r"rank|dimension"):
            session.run({"x": np.zeros((1, 3, 64), np.float32)})
        assert session._shrink is refused  # a bad input says nothing about the shrink
        with caplog.at_level(logging.WARNING, logger="agent.models.backends.onnxruntime"):
            assert session.run(SMALL)
            assert session.run(SMALL)
        warnings = [r for r in caplog.records if "refused to shrink" in r.getMessage()]
        assert len(warnings) == 1 and session._shrink is None
    finally:
        session.close()


def test_a_gpu_session_asks_its_device_arena_too_and_drops_it_where_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A session on the CUDA (or TensorRT) provider asks for `cpu:0;gpu:N`, N its device.
    Where ONNX Runtime refuses the device arena's shrink, the run is made again without it and
    later runs ask for the CPU arena's alone, with one warning (here on the CPU, whose ONNX
    Runtime has no `gpu:0` arena to shrink)."""

    class CudaSession:  # what OnnxSession reads of an InferenceSession on GPU 1
        def get_inputs(self) -> list[object]:
            return []

        def get_outputs(self) -> list[object]:
            return []

        def get_providers(self) -> list[str]:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def get_provider_options(self) -> dict[str, dict[str, str]]:
            return {"CUDAExecutionProvider": {"device_id": "1"}}

    on_gpu = OnnxSession(CudaSession(), DETECTOR)
    assert on_gpu._shrink.get_run_config_entry(ort_backend.SHRINK_KEY) == "cpu:0;gpu:1"
    assert on_gpu._shrink_cpu.get_run_config_entry(ort_backend.SHRINK_KEY) == "cpu:0"

    monkeypatch.setattr(ort_backend, "SHRINK_EVERY_S", 0.0)
    session = OnnxRuntimeBackend().load(DETECTOR, BackendOptions(intra_op_threads=1))
    try:
        assert session._shrink is session._shrink_cpu  # a CPU session: its CPU arena's
        combined = ort_backend._shrink_options("cpu:0;gpu:0")
        if _accepted(session, combined):
            pytest.skip("this ONNX Runtime does not check a shrink list's later entries (1.23)")
        session._shrink = combined
        with caplog.at_level(logging.WARNING, logger="agent.models.backends.onnxruntime"):
            assert session.run(SMALL)
            assert session.run(SMALL)
        warnings = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(warnings) == 1 and "GPU memory arena" in warnings[0], warnings
        assert session._shrink is session._shrink_cpu
    finally:
        session.close()


def _accepted(session: OnnxSession, options: object) -> bool:
    """Whether ONNX Runtime runs `session` with `options` (on the CPU: whether it checks the
    `gpu:0` after a `cpu:0` in a shrink list; 1.32 does, 1.23 does not)."""
    try:
        session._session.run(None, SMALL, options)
    except Exception:
        return False
    return True


def idle_release(folder: str, warmup: str, small_first: str) -> dict[str, Any]:
    """Scenario: the detector as version 1 of a repository in `folder` ([warmup] enabled
    where `warmup` is "on"), `SHRINK_EVERY_S` an hour; a large request (after a small one where
    `small_first` is "yes", else before it), the manager's sync before and after
    `IDLE_RELEASE_S` passed, and once more with nothing run since; resident bytes over those
    before the large request after each."""
    from agent.models.backends import base
    from agent.models.manager import ModelManager

    ort_backend.SHRINK_EVERY_S = 3600.0  # no request shrinks it here
    root = Path(folder)
    (root / "ocr" / "1").mkdir(parents=True)
    shutil.copy(DETECTOR, root / "ocr" / "1" / "model.onnx")
    if warmup != "on":
        (root / "ocr" / "config.toml").write_text("[warmup]\nenabled = false\n")
    manager = ModelManager(root, BackendOptions(intra_op_threads=1), settle_s=0)
    try:
        manager.sync()
        warmed = manager.inventory()["models"]["ocr"]["versions"]["1"]["warmup"]
        with manager.lease("ocr") as lease:
            if small_first == "yes":
                lease.session.run(SMALL)
            before = rss()
            lease.session.run(LARGE)  # over the size a session keeps: never kept
            if small_first != "yes":
                lease.session.run(SMALL)
            grown = rss() - before
        manager.sync()  # not idle long enough
        not_yet = rss() - before
        base.IDLE_RELEASE_S = 0.0
        manager.sync()
        released = rss() - before
        manager.sync()  # nothing ran since: no second shrinking run
        again = rss() - before
        return {
            "warmup": warmed,
            "grown": grown,
            "not_yet": not_yet,
            "released": released,
            "again": again,
        }
    finally:
        manager.close(drain_timeout=1)


def test_an_idle_session_shrinks_its_arena_with_its_warm_up_inputs(tmp_path: Path) -> None:
    """The manager's sync asks every loaded session to give back what it keeps once idle for
    `IDLE_RELEASE_S`: an ONNX Runtime session runs the warm-up's inputs (kept when it loaded)
    once with the shrink, so a large request's memory goes without another request."""
    got = in_fresh_process("idle_release", str(tmp_path / "models"), "on", "yes")
    grown = got["grown"]
    assert got["warmup"] == "ok", got
    assert grown > 32 * MIB and got["not_yet"] > 0.75 * grown, got
    assert got["released"] < 0.25 * grown, got
    assert abs(got["again"] - got["released"]) < 4 * MIB, got


def test_a_version_served_without_a_warm_up_shrinks_with_a_requests_inputs(
    tmp_path: Path,
) -> None:
    """`[warmup] enabled = false`: no warm-up inputs are kept, so the session keeps a copy of
    the first small request's, and the idle release runs those."""
    got = in_fresh_process("idle_release", str(tmp_path / "models"), "off", "no")
    grown = got["grown"]
    assert got["warmup"] != "ok", got
    assert grown > 32 * MIB and got["not_yet"] > 0.75 * grown, got
    assert got["released"] < 0.25 * grown, got
