"""Hot swap: versions dropped into the watched folder while the agent serves, none dropped."""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from agent.client import AgentError
from agent.demo import models as demo_models
from agent.models.backends.base import BackendOptions
from agent.models.manager import ModelManager
from agent.service.agent import Agent
from tests.conftest import agent_config

BATCH_CONFIG = '[stream]\nmode = "batch"\nmicro_batch = 4\n'


def mlp_bytes(seed: int, inputs: int = 16) -> bytes:
    return demo_models.to_bytes(demo_models.mlp(inputs=inputs, seed=seed))


def direct(seed: int, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(mlp_bytes(seed), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": x})[0]


def make_repo(
    root: Path, versions: dict[int, int], extra_config: str = "", config: str = BATCH_CONFIG
) -> Path:
    """models/mlp/{version}/model.onnx from mlp(seed=...); its config.toml is `config` (batch
    mode) and `extra_config`."""
    (root / "mlp").mkdir(parents=True)
    (root / "mlp" / "config.toml").write_text(config + extra_config)
    for version, seed in versions.items():
        (root / "mlp" / str(version)).mkdir()
        (root / "mlp" / str(version) / "model.onnx").write_bytes(mlp_bytes(seed))
    return root


def drop_version(root: Path, model: str, version: int, data: bytes, sha256: str | None = None):
    """What an OTA tool does: write into a hidden staging folder, then rename into place."""
    staging = root / model / f".{version}.tmp"
    staging.mkdir()
    (staging / "model.onnx").write_bytes(data)
    if sha256 is not None:
        (staging / "model.sha256").write_text(f"{sha256}  model.onnx\n")
    os.rename(staging, root / model / str(version))


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def serving(agent, model: str = "mlp"):
    return agent.models.inventory()["models"].get(model, {}).get("serving")


def listen_events(client, agent) -> queue.Queue[dict]:
    events: queue.Queue[dict] = queue.Queue()
    client.listen(f"{agent.root}/events", lambda t, m, raw: events.put(m))
    return events


def drain(events: queue.Queue[dict]) -> list[dict]:
    out = []
    while True:
        try:
            out.append(events.get_nowait())
        except queue.Empty:
            return out


@pytest.mark.slow
def test_three_swaps_under_continuous_load(broker, make_agent, make_client, tmp_path):
    root = make_repo(tmp_path / "models", {1: 101})
    agent = make_agent(broker, root, MODELS__DEBOUNCE_S="0.05")
    client = make_client(broker, agent)
    x = np.random.default_rng(5).standard_normal((6, 16)).astype(np.float32)
    expected = {v: direct(100 + v, x) for v in (1, 2, 3, 4)}
    results: list[tuple[int | None, np.ndarray | None, str | None]] = []
    stop = threading.Event()

    def load() -> None:
        replies = []
        while not stop.is_set():
            replies.append(client.request("mlp", {"x": x}, timeout=20))
            time.sleep(0.01)
        for reply in replies:
            try:
                chunks = list(reply)
                assert reply.end is not None and reply.end.chunks == len(chunks) == 2
                results.append(
                    (reply.version, np.concatenate([c.outputs["y"] for c in chunks]), None)
                )
            except AgentError as e:
                results.append((None, None, e.code))

    thread = threading.Thread(target=load, name="test-load")
    thread.start()
    try:
        time.sleep(0.5)
        drop_version(root, "mlp", 2, mlp_bytes(102))
        assert wait_for(lambda: serving(agent) == 2)
        time.sleep(0.5)
        drop_version(root, "mlp", 3, mlp_bytes(103))
        assert wait_for(lambda: serving(agent) == 3)
        time.sleep(0.5)
        # The third arrives by an in-place copy, not a rename.
        (root / "mlp" / "4").mkdir()
        shutil.copyfile(
            _write(tmp_path / "m4.onnx", mlp_bytes(104)), root / "mlp" / "4" / "model.onnx"
        )
        assert wait_for(lambda: serving(agent) == 4)
        time.sleep(0.5)
    finally:
        stop.set()
        thread.join(60)
    assert len(results) > 100
    failures = [code for _, _, code in results if code is not None]
    assert failures == []
    seen = {version for version, _, _ in results}
    assert seen == {1, 2, 3, 4}
    for version, outputs, _ in results:
        np.testing.assert_allclose(outputs, expected[version], rtol=1e-5)
    # Only the serving version and one older one stay loaded; the rest were closed.
    versions = agent.models.inventory()["models"]["mlp"]["versions"]
    assert versions["4"]["state"] == "ready" and versions["3"]["state"] == "ready"
    assert versions["1"]["state"] == versions["2"]["state"] == "unloaded"


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_garbage_version_fails_and_the_old_one_keeps_serving(
    broker, make_agent, make_client, tmp_path
):
    root = make_repo(tmp_path / "models", {1: 101})
    agent = make_agent(broker, root, MODELS__DEBOUNCE_S="0.05")
    client = make_client(broker, agent)
    events = listen_events(client, agent)
    drop_version(root, "mlp", 2, os.urandom(5000))
    assert wait_for(
        lambda: (
            agent.models.inventory()["models"]["mlp"]["versions"].get("2", {}).get("state")
            == "failed"
        )
    )
    entry = agent.models.inventory()["models"]["mlp"]["versions"]["2"]
    assert "cannot load" in entry["error"]
    assert serving(agent) == 1
    x = np.ones((4, 16), dtype=np.float32)
    reply = client.request("mlp", {"x": x})
    assert len(list(reply)) == 1 and reply.version == 1
    assert wait_for(lambda: any(e["type"] == "model_load_failed" for e in list(events.queue)))
    failed = next(e for e in drain(events) if e["type"] == "model_load_failed")
    assert failed["model"] == "mlp" and failed["version"] == 2 and failed["error"]

    # A fixed copy of the same version is retried and served.
    fixed = root / "mlp" / "2" / "model.onnx"
    _write(tmp_path / "fixed.onnx", mlp_bytes(102))
    os.replace(tmp_path / "fixed.onnx", fixed)
    assert wait_for(lambda: serving(agent) == 2)
    assert wait_for(lambda: any(e["type"] == "model_swapped" for e in list(events.queue)))
    swapped = next(e for e in drain(events) if e["type"] == "model_swapped")
    assert swapped["from"] == 1 and swapped["to"] == 2


def test_a_fix_in_a_failed_version_is_found_without_a_file_event(tmp_path):
    """A broken version is what an operator fixes next, and the fix's file event can be lost:
    watchdog 6 (what Python 3.10 gets) may leave a folder renamed into place unwatched, and a
    network file system sends none. While a version is failed, the disk is looked at again
    every FAILED_RECHECK_S, so the fix is served without an event and long before the rescan."""
    from agent.models.manager import FAILED_RECHECK_S
    from agent.models.watcher import RepositoryWatcher

    root = make_repo(tmp_path / "models", {1: 101})
    drop_version(root, "mlp", 2, os.urandom(5000))
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    assert manager.sync() is None  # nothing settling: the start needs no second look
    assert manager.inventory()["models"]["mlp"]["versions"]["2"]["state"] == "failed"
    assert manager.recheck_s() == FAILED_RECHECK_S  # but v2 failed: the watcher looks soon
    watcher = RepositoryWatcher(root, manager, mode="off", rescan_s=600)  # no file events
    watcher.start()
    try:
        fixed = _write(tmp_path / "fixed.onnx", mlp_bytes(102))
        os.replace(fixed, root / "mlp" / "2" / "model.onnx")
        assert wait_for(lambda: _serving_version(manager) == 2)
        assert manager.recheck_s() is None  # nothing failed any more: no early look
    finally:
        watcher.close()
        manager.close()


def _serving_version(manager: ModelManager) -> int | None:
    return manager.inventory()["models"]["mlp"].get("serving")


def test_slow_copy_in_place_is_served_once_complete(broker, make_agent, tmp_path):
    root = make_repo(tmp_path / "models", {1: 101})
    agent = make_agent(broker, root, MODELS__DEBOUNCE_S="0.05", MODELS__SETTLE_S="0.5")
    data = mlp_bytes(102)
    (root / "mlp" / "2").mkdir()
    target = root / "mlp" / "2" / "model.onnx"
    states = []
    pieces = np.array_split(np.frombuffer(data, dtype=np.uint8), 20)
    with open(target, "wb") as f:
        for piece in pieces:  # 20 writes over 3 s
            f.write(piece.tobytes())
            f.flush()
            states.append(
                agent.models.inventory()["models"]["mlp"]["versions"].get("2", {}).get("state")
            )
            time.sleep(0.15)
    assert wait_for(lambda: serving(agent) == 2, timeout=10)
    assert "failed" not in states and "loading" not in states
    assert "failed" not in {agent.models.inventory()["models"]["mlp"]["versions"]["2"]["state"]}


def test_checksum_mismatch_is_refused(broker, make_agent, tmp_path):
    root = make_repo(tmp_path / "models", {1: 101})
    agent = make_agent(broker, root, MODELS__DEBOUNCE_S="0.05")
    drop_version(root, "mlp", 2, mlp_bytes(102), sha256="0" * 64)
    assert wait_for(
        lambda: (
            agent.models.inventory()["models"]["mlp"]["versions"].get("2", {}).get("state")
            == "failed"
        )
    )
    entry = agent.models.inventory()["models"]["mlp"]["versions"]["2"]
    assert "checksum mismatch" in entry["error"]
    assert serving(agent) == 1
    import hashlib

    drop_version(root, "mlp", 3, mlp_bytes(103), sha256=hashlib.sha256(mlp_bytes(103)).hexdigest())
    assert wait_for(lambda: serving(agent) == 3)


def test_incompatible_version_is_refused_unless_allowed(broker, make_agent, tmp_path):
    root = make_repo(tmp_path / "models", {1: 101})
    agent = make_agent(broker, root, MODELS__DEBOUNCE_S="0.05")
    drop_version(root, "mlp", 2, mlp_bytes(102, inputs=8))
    assert wait_for(
        lambda: (
            agent.models.inventory()["models"]["mlp"]["versions"].get("2", {}).get("state")
            == "failed"
        )
    )
    assert "incompatible" in agent.models.inventory()["models"]["mlp"]["versions"]["2"]["error"]
    assert serving(agent) == 1
    (root / "mlp" / "config.toml").write_text(
        BATCH_CONFIG + "[policy]\nrequire_compatible = false\n"
    )
    # A changed config does not change the broken files; a new copy of them is retried.
    drop_version(root, "mlp", 3, mlp_bytes(103, inputs=8))
    assert wait_for(lambda: serving(agent) == 3)


@pytest.mark.parametrize("keep_loaded", [1, 2])
def test_removing_versions_and_models(broker, make_agent, make_client, tmp_path, keep_loaded):
    """Removing the serving version: the next one serves (at once where it is still loaded,
    `keep_loaded = 2`; else once it loads), with one `model_swapped`."""
    policy = f"[policy]\nkeep_loaded = {keep_loaded}\n"
    root = make_repo(tmp_path / "models", {1: 101}, policy)
    agent = make_agent(broker, root, MODELS__DEBOUNCE_S="0.05")
    client = make_client(broker, agent)
    assert serving(agent) == 1
    (root / ".2.tmp").mkdir()
    (root / ".2.tmp" / "model.onnx").write_bytes(mlp_bytes(102))
    (root / ".2.tmp").rename(root / "mlp" / "2")
    assert wait_for(lambda: serving(agent) == 2)
    seen: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    for topic in ("events", "models"):
        client.listen(f"{agent.root}/{topic}", lambda t, m, raw: seen.put((t, m or {})))
    time.sleep(0.2)  # subscribed (the retained inventory comes first)
    shutil.rmtree(root / "mlp" / "2")
    assert wait_for(lambda: serving(agent) == 1)
    assert "2" not in agent.models.inventory()["models"]["mlp"]["versions"]
    assert wait_for(lambda: "2" not in _published_versions(seen.queue))
    swaps = [m for t, m in list(seen.queue) if m.get("type") == "model_swapped"]
    assert [(m["from"], m["to"]) for m in swaps] == [(2, 1)]
    if keep_loaded == 2:  # v1 serves before v2 is retired: no inventory with none serving
        inventories = [m for t, m in list(seen.queue) if t.endswith("/models")]
        assert [m["models"]["mlp"]["serving"] for m in inventories].count(None) == 0
    reply = client.request("mlp", {"x": np.ones((1, 16), dtype=np.float32)})
    assert len(list(reply)) == 1 and reply.version == 1

    # A new model folder at run time, then the old model removed.
    (root / "other" / "1").mkdir(parents=True)
    (root / "other" / "1" / "model.onnx").write_bytes(mlp_bytes(7))
    assert wait_for(lambda: serving(agent, "other") == 1)
    shutil.rmtree(root / "mlp")
    assert wait_for(lambda: "mlp" not in agent.models.inventory()["models"])
    with pytest.raises(AgentError) as info:
        list(client.request("mlp", {"x": np.ones((1, 16), dtype=np.float32)}, timeout=5))
    assert info.value.code == "unknown_model"


def _published_versions(seen: Any) -> set[str]:
    """The mlp versions of the last inventory published in `seen` ((topic, message) items)."""
    inventories = [m for t, m in list(seen) if t.endswith("/models")]
    return set(inventories[-1]["models"]["mlp"]["versions"]) if inventories else {"2"}


def test_polling_observer_fallback(broker, make_agent, tmp_path):
    root = make_repo(tmp_path / "models", {1: 101})
    agent = make_agent(
        broker,
        root,
        MODELS__WATCH='"poll"',
        MODELS__POLL_INTERVAL_S="0.1",
        MODELS__DEBOUNCE_S="0.05",
    )
    assert agent.watcher.backend == "PollingObserver"
    drop_version(root, "mlp", 2, mlp_bytes(102))
    assert wait_for(lambda: serving(agent) == 2)
    names = {t.name for t in threading.enumerate()}
    assert {"model-watcher", "model-watcher-events", "model-watcher-emitter"} <= names


def test_a_leased_version_is_closed_only_after_its_last_lease(tmp_path):
    root = make_repo(tmp_path / "models", {1: 101}, "[policy]\nkeep_loaded = 0\n")
    events: list[dict] = []
    manager = ModelManager(
        root, BackendOptions(), on_event=events.append, settle_s=0.0, drain_timeout_s=60
    )
    manager.sync()
    lease = manager.lease("mlp")
    assert lease.loaded.version == 1
    drop_version(root, "mlp", 2, mlp_bytes(102))
    drop_version(root, "mlp", 3, mlp_bytes(103))
    for _ in range(3):
        manager.sync()
    assert manager.inventory()["models"]["mlp"]["serving"] == 3
    assert manager.inventory()["models"]["mlp"]["versions"]["1"]["state"] == "draining"
    # The leased, retired version still runs.
    out = lease.session.run({"x": np.ones((2, 16), dtype=np.float32)})
    np.testing.assert_allclose(out["y"], direct(101, np.ones((2, 16), dtype=np.float32)), rtol=1e-5)
    assert not any(e["type"] == "model_unloaded" and e["version"] == 1 for e in events)
    lease.release()
    assert any(e["type"] == "model_unloaded" and e["version"] == 1 for e in events)
    assert manager.inventory()["models"]["mlp"]["versions"]["1"]["state"] == "unloaded"
    manager.close()


def test_drain_timeout_closes_a_stuck_lease(tmp_path):
    root = make_repo(tmp_path / "models", {1: 101}, "[policy]\nkeep_loaded = 0\n")
    manager = ModelManager(root, BackendOptions(), settle_s=0.0, drain_timeout_s=0.0)
    manager.sync()
    lease = manager.lease("mlp")
    drop_version(root, "mlp", 2, mlp_bytes(102))
    drop_version(root, "mlp", 3, mlp_bytes(103))
    for _ in range(3):
        manager.sync()
    from agent.models.backends.base import InferenceError

    with pytest.raises(InferenceError):
        lease.session.run({"x": np.ones((1, 16), dtype=np.float32)})
    lease.release()
    manager.close()


def test_a_version_dropped_during_startup_is_seen_at_once(broker, tmp_path):
    """The folder is watched before the first sync: a version written while the agent
    starts is loaded within seconds, not at the next 30 s rescan."""
    root = make_repo(tmp_path / "models", {1: 101})
    config = agent_config(tmp_path, broker, root, models__rescan_s="600")
    agent = Agent(config)
    starter = threading.Thread(target=agent.start, name="test-agent-start")
    try:
        starter.start()
        time.sleep(0.05)
        drop_version(root, "mlp", 2, mlp_bytes(102))
        starter.join(10)
        assert wait_for(lambda: serving(agent) == 2, timeout=5.0)
    finally:
        starter.join(10)
        agent.stop()


def test_a_loop_of_links_in_one_model_fails_that_version_only(tmp_path):
    """`ln -s 11 models/mlp/11` made every sync raise: no model could be added, swapped or
    removed anywhere until the link was gone."""
    root = make_repo(tmp_path / "models", {1: 101})
    os.symlink("11", root / "mlp" / "11")
    (root / "other" / "1").mkdir(parents=True)
    (root / "other" / "1" / "model.onnx").write_bytes(mlp_bytes(7))
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        models = manager.inventory()["models"]
        assert models["other"]["serving"] == 1 and models["mlp"]["serving"] == 1
        looped = models["mlp"]["versions"]["11"]
        assert looped["state"] == "failed" and "loop of symbolic links" in looped["error"]
    finally:
        manager.close()


def test_the_serving_version_renamed_falls_back_to_a_loaded_one_before_the_new_loads(
    tmp_path,
):
    """`mv 2 3` while v1 is still loaded: v1 serves at once, while v3 loads (requests got
    unknown_model for as long as the new version took to load)."""
    root = make_repo(tmp_path / "models", {1: 101})
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        drop_version(root, "mlp", 2, mlp_bytes(102))
        manager.mark_complete(root / "mlp" / "2")
        manager.sync()
        assert _serving_version(manager) == 2  # v1 stays loaded (keep_loaded = 1)
        serving_while_loading: list[int | None] = []
        load = manager._load

        def spying(record: Any, version: Any, *args: Any) -> Any:
            serving_while_loading.append(record.serving.version if record.serving else None)
            return load(record, version, *args)

        manager._load = spying  # type: ignore[method-assign]
        os.rename(root / "mlp" / "2", root / "mlp" / "3")
        manager.mark_complete(root / "mlp" / "3")  # as the watcher does for a rename
        manager.sync()
        assert serving_while_loading == [1] and _serving_version(manager) == 3
    finally:
        manager.close()


def test_a_version_failed_by_its_models_config_is_tried_again_once_the_config_is_fixed(
    tmp_path,
):
    """The config broken, a version dropped, the config restored: the version's own files
    never changed, yet it loads (it stayed failed with the old config error)."""
    root = make_repo(tmp_path / "models", {1: 101})
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        good = (root / "mlp" / "config.toml").read_text()
        (root / "mlp" / "config.toml").write_text(good + "bogus = 1\n")
        drop_version(root, "mlp", 2, mlp_bytes(102))
        manager.sync()
        assert manager.inventory()["models"]["mlp"]["versions"]["2"]["state"] == "failed"
        (root / "mlp" / "config.toml").write_text(good)
        manager.sync()
        manager.sync()  # settled: unchanged since the last look
        assert _serving_version(manager) == 2
    finally:
        manager.close()


def test_an_unreadable_model_folder_keeps_its_loaded_versions_serving(tmp_path, monkeypatch):
    """A chmod under way (the folder cannot be listed for a moment) is not a deletion: the
    model was unloaded and its requests got unknown_model."""
    from agent.models import repository

    root = make_repo(tmp_path / "models", {1: 101})
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        scan = repository._scan_model

        def unreadable(folder: Path, root: Path) -> Any:
            if folder.name == "mlp":
                raise PermissionError(13, "Permission denied")
            return scan(folder, root)

        monkeypatch.setattr(repository, "_scan_model", unreadable)
        manager.sync()
        assert _serving_version(manager) == 1
    finally:
        manager.close()


def test_empty_version_folders_fail_without_a_load_each(tmp_path):
    """Versions the scan already found broken (no model file) are marked failed directly:
    each went through a load that published the whole inventory, so 2,000 empty folders
    took 37 s of syncing."""
    root = make_repo(tmp_path / "models", {1: 101})
    for number in range(2, 52):
        (root / "mlp" / str(number)).mkdir()
    published: list[int] = []
    manager = ModelManager(
        root, BackendOptions(), settle_s=0.0, on_inventory=lambda: published.append(1)
    )
    try:
        manager.sync()
        versions = manager.inventory()["models"]["mlp"]["versions"]
        assert all(versions[str(n)]["state"] == "failed" for n in range(2, 52))
        assert _serving_version(manager) == 1
        assert len(published) <= 3
    finally:
        manager.close()


def test_an_empty_folder_renamed_into_place_still_waits_for_its_files_to_settle(tmp_path):
    """Renamed in empty, then copied into: its files are not complete at the rename (a
    half-copied file was loaded, and failed, before the copy ended)."""
    root = make_repo(tmp_path / "models", {1: 101})
    manager = ModelManager(root, BackendOptions(), settle_s=0.0)
    try:
        manager.sync()
        (root / "mlp" / ".3.tmp").mkdir()
        os.rename(root / "mlp" / ".3.tmp", root / "mlp" / "3")
        manager.mark_complete(root / "mlp" / "3")  # the watcher saw the rename
        (root / "mlp" / "3" / "model.onnx").write_bytes(mlp_bytes(103)[:500])  # copy under way
        manager.sync()
        assert manager.inventory()["models"]["mlp"]["versions"]["3"]["state"] == "unloaded"
        assert _serving_version(manager) == 1
        (root / "mlp" / "3" / "model.onnx").write_bytes(mlp_bytes(103))
        manager.sync()
        manager.sync()
        assert _serving_version(manager) == 3
    finally:
        manager.close()


def test_a_version_copied_in_place_reports_no_failure_while_it_settles(tmp_path):
    """`mkdir 3; cp model.onnx 3/`: the folder is empty, then its file half-written, for a
    moment: neither is reported failed while it settles (an ERROR and a model_load_failed
    each, before it loaded)."""
    events: list[dict[str, Any]] = []
    root = make_repo(tmp_path / "models", {1: 101})
    manager = ModelManager(root, BackendOptions(), settle_s=0.0, on_event=events.append)
    try:
        manager.sync()
        (root / "mlp" / "3").mkdir()
        manager.sync()
        (root / "mlp" / "3" / "model.onnx").write_bytes(b"")
        manager.sync()
        (root / "mlp" / "3" / "model.onnx").write_bytes(mlp_bytes(103))
        manager.sync()
        manager.sync()
        assert _serving_version(manager) == 3
        assert not [e for e in events if e["type"] == "model_load_failed"]
    finally:
        manager.close()
