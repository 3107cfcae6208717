"""Engine builds are visible: an ONNX version under `backend = "tensorrt"` is `building` with
`progress` while the agent builds its engine, then `ready`; `engine_build_started` and
`engine_build_finished` events (cache hit or miss, ok or not).

Runs against the tensorrt/pycuda test doubles (tests/fakes); the end-to-end test goes
through a real Mosquitto. A build is held at a step by ``FakeGPU.build_hook``, so nothing
here depends on timing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.models.backends.base import BackendOptions, ModelLoadError
from agent.models.engine_builder.progress import PhaseTracker
from agent.models.engine_builds import DURATIONS_FILE, build_options
from agent.models.manager import ModelManager
from agent.models.records import format_inventory
from tests import fakes
from tests.fakes import FakeGPU
from tests.ops_helpers import listen, wait_message
from tests.test_hot_swap import direct, drop_version, make_repo, mlp_bytes, serving, wait_for

fake_gpu = fakes.fake_gpu  # the fixture: fresh fakes in sys.modules per test

CONFIG = 'backend = "tensorrt"\n[backend_options.tensorrt.build]\nmax_batch = 4\n'
X = np.ones((2, 16), dtype=np.float32)


@pytest.fixture(autouse=True)
def engine_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The agent's engine cache ($XDG_CACHE_HOME/edge-agent/engines) in this test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "edge-agent" / "engines"


class Gate:
    """Holds the fake build at one step until released: `reached` is set when it got there."""

    def __init__(self, phase: str, step: int) -> None:
        self.at = (phase, step)
        self.reached = threading.Event()
        self.released = threading.Event()
        self.armed = False

    def __call__(self, phase: str, step: int) -> None:
        if self.armed and (phase, step) == self.at:
            self.reached.set()
            self.released.wait(30)

    def release(self) -> None:
        self.armed = False
        self.released.set()


@pytest.fixture
def gate(fake_gpu: FakeGPU) -> Iterator[Gate]:
    held = Gate("Tactic selection", 1)
    fake_gpu.build_hook = held
    yield held
    held.release()


def state(inventory: dict[str, Any], version: int) -> dict[str, Any]:
    entry = inventory["models"].get("mlp", {}).get("versions", {}).get(str(version), {})
    return dict(entry)


# --------------------------------------------------------------------------- units


def test_phase_fractions_follow_nested_steps() -> None:
    tracker = PhaseTracker(lambda line: None)
    assert tracker.snapshot() == (None, [])
    tracker.start("Building engine", None, 2)
    tracker.start("Tactic selection", "Building engine", 4)
    tracker.step("Tactic selection", 0)
    tracker.step("Tactic selection", 1)
    fraction, phases = tracker.snapshot()
    assert fraction == pytest.approx((0 + 2 / 4) / 2)
    assert phases == [
        {"name": "Building engine", "step": 0, "steps": 2},
        {"name": "Tactic selection", "step": 2, "steps": 4},
    ]
    tracker.finish("Tactic selection")
    tracker.step("Building engine", 0)
    assert tracker.snapshot()[0] == pytest.approx(0.5)
    assert tracker.keep_going()
    tracker.cancel()
    assert not tracker.keep_going()


def test_build_options_come_from_the_tensorrt_table() -> None:
    extra = {"tensorrt": {"device": 0, "build": {"fp16": True, "workspace_mib": 64}}}
    options = build_options(BackendOptions(extra=extra))
    assert options.fp16 and options.workspace_bytes == 64 * 1024 * 1024
    profile = {"profiles": ["x:1x16/2x16/4x16"], "max_batch": 4}
    assert len(build_options(BackendOptions(extra={"tensorrt": {"build": profile}})).profiles) == 1
    bad = [
        ({"fp17": True}, "unknown tensorrt.build option(s) fp17"),
        ({"fp16": "yes"}, "tensorrt.build.fp16 must be true or false"),
        ({"workspace_mib": 0}, "tensorrt.build.workspace_mib must be an integer >= 1"),
        ({"profiles": ["x:1/2"]}, "tensorrt.build: 'x:1/2': expected NAME:MIN/OPT/MAX"),
    ]
    for table, message in bad:
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            build_options(BackendOptions(extra={"tensorrt": {"build": table}}))


# --------------------------------------------------------------------------- the manager


def manager_for(root: Path, events: list[dict[str, Any]]) -> ModelManager:
    return ModelManager(root, BackendOptions(), settle_s=0.0, on_event=events.append)


@pytest.mark.parametrize("fake_gpu", ["8.6.1"], indirect=True)
def test_without_a_progress_monitor_the_last_builds_duration_is_the_estimate(
    fake_gpu: FakeGPU, gate: Gate, tmp_path: Path, engine_cache: Path
) -> None:
    events: list[dict[str, Any]] = []
    manager = manager_for(make_repo(tmp_path / "models", {1: 1}, config=CONFIG), events)
    try:
        manager.sync()
        assert wait_for(lambda: state(manager.inventory(), 1).get("state") == "ready")
        first = next(e for e in events if e["type"] == "engine_build_finished")
        last = json.loads((engine_cache / DURATIONS_FILE).read_text())["mlp"]
        assert last == pytest.approx(first["duration_s"], abs=1e-2)
        gate.armed = True
        drop_version(tmp_path / "models", "mlp", 2, mlp_bytes(2))
        manager.mark_complete(tmp_path / "models" / "mlp" / "2")  # what the watcher does
        manager.sync()
        assert gate.reached.wait(10)
        building = state(manager.inventory(), 2)
        assert building["state"] == "building"
        progress = building["progress"]
        assert progress["fraction"] is None and progress["phases"] == []  # TensorRT 8.6
        assert progress["estimate_s"] == last and progress["queued"] is False
        assert "progress:" in format_inventory(manager.inventory())
        assert manager.inventory()["models"]["mlp"]["serving"] == 1
        with manager.lease("mlp") as lease:  # the serving version keeps answering
            got = lease.session.run({"x": X})["y"]
        np.testing.assert_allclose(got, direct(1, X), rtol=1e-5)
        gate.release()
        assert wait_for(lambda: manager.inventory()["models"]["mlp"]["serving"] == 2)
        assert "progress" not in state(manager.inventory(), 2)
    finally:
        manager.close()


def test_a_tampered_version_is_not_built(fake_gpu: FakeGPU, tmp_path: Path) -> None:
    events: list[dict[str, Any]] = []
    root = make_repo(tmp_path / "models", {1: 1}, config=CONFIG)
    (root / "mlp" / "1" / "model.sha256").write_text("0" * 64 + "  model.onnx\n")
    manager = manager_for(root, events)
    try:
        manager.sync()
        entry = state(manager.inventory(), 1)
        assert entry["state"] == "failed" and "checksum mismatch" in entry["error"]
        assert fake_gpu.builds == 0
        assert not [e for e in events if e["type"].startswith("engine_build")]
    finally:
        manager.close()


def test_closing_cancels_a_running_build(
    fake_gpu: FakeGPU, gate: Gate, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.models.engine_builds")
    events: list[dict[str, Any]] = []
    manager = manager_for(make_repo(tmp_path / "models", {1: 1}, config=CONFIG), events)
    gate.armed = True
    manager.sync()
    assert gate.reached.wait(10)
    closer = threading.Thread(target=manager.close, name="test-closer")
    closer.start()
    assert wait_for(lambda: "cancelled, the agent is stopping" in caplog.text)  # close() waits
    gate.release()  # the next step_complete returns False: TensorRT cancels the build
    closer.join(10)
    assert not closer.is_alive()
    assert fake_gpu.builds == 0  # cancelled, not finished
    assert [e["type"] for e in events] == ["engine_build_started"]
    assert not [t for t in threading.enumerate() if t.name.startswith("engine-build")]


# --------------------------------------------------------------------------- through a broker


def test_building_with_progress_then_ready_through_the_broker(
    broker: Any,
    make_agent: Callable[..., Any],
    make_client: Callable[..., Any],
    fake_gpu: FakeGPU,
    gate: Gate,
    tmp_path: Path,
    engine_cache: Path,
) -> None:
    root = make_repo(tmp_path / "models", {1: 1}, config=CONFIG)
    agent = make_agent(broker, root)
    assert wait_for(lambda: serving(agent) == 1)
    client = make_client(broker, agent)
    inventories = listen(client, f"{agent.root}/models")
    events = listen(client, f"{agent.root}/events")

    # A new version that needs a build: building, with phase fractions, while v1 serves.
    gate.armed = True
    drop_version(root, "mlp", 2, mlp_bytes(2))
    started = wait_message(events, lambda m: m.get("type") == "engine_build_started", timeout=15)
    assert started["model"] == "mlp" and started["version"] == 2
    assert isinstance(started["estimate_s"], float)  # v1's build
    assert gate.reached.wait(15)
    building = wait_message(
        inventories,
        lambda m: bool(state(m, 2).get("progress", {}).get("phases")),
        timeout=15,
    )
    assert state(building, 2)["state"] == "building"
    assert building["models"]["mlp"]["serving"] == 1
    progress = state(building, 2)["progress"]
    assert 0 < progress["fraction"] < 1
    assert [p["name"] for p in progress["phases"]] == ["Building engine", "Tactic selection"]
    assert progress["estimate_s"] == started["estimate_s"]
    np.testing.assert_allclose(client.infer("mlp", {"x": X})["y"], direct(1, X), rtol=1e-5)

    gate.release()
    finished = wait_message(events, lambda m: m.get("type") == "engine_build_finished", timeout=15)
    assert finished["version"] == 2 and finished["ok"] is True and finished["cache"] == "miss"
    assert finished["duration_s"] >= 0 and finished["key"] == started["key"]
    ready = wait_message(inventories, lambda m: m["models"]["mlp"]["serving"] == 2, timeout=15)
    assert state(ready, 2)["state"] == "ready" and state(ready, 2)["backend"] == "tensorrt"
    np.testing.assert_allclose(client.infer("mlp", {"x": X})["y"], direct(2, X), rtol=1e-4)
    assert (engine_cache / f"{started['key']}.plan").is_file()
    assert sorted(os.listdir(root / "mlp" / "2")) == ["model.onnx"]  # nothing written there

    # The same ONNX again: a cache hit, never `building`, no started event.
    drop_version(root, "mlp", 3, mlp_bytes(2))
    hit = wait_message(events, lambda m: m.get("type", "").startswith("engine_build"), timeout=15)
    assert hit["type"] == "engine_build_finished" and hit["cache"] == "hit"
    assert hit["version"] == 3 and hit["ok"] is True and hit["key"] == started["key"]
    seen = wait_message(inventories, lambda m: m["models"]["mlp"]["serving"] == 3, timeout=15)
    assert state(seen, 3)["state"] == "ready"
    builds = fake_gpu.builds

    # A build that fails: `failed` with the reason, ok = false, v3 keeps serving.
    drop_version(root, "mlp", 4, b"\x08\x07 not an onnx model")
    failed = wait_message(events, lambda m: m.get("type") == "engine_build_finished", timeout=15)
    assert failed["version"] == 4 and failed["ok"] is False and failed["cache"] == "miss"
    assert "ONNX parser" in failed["error"]
    broken = wait_message(inventories, lambda m: state(m, 4).get("state") == "failed", timeout=15)
    assert state(broken, 4)["error"] == failed["error"]
    assert broken["models"]["mlp"]["serving"] == 3 and fake_gpu.builds == builds
    np.testing.assert_allclose(client.infer("mlp", {"x": X})["y"], direct(2, X), rtol=1e-4)
