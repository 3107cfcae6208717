"""State files under attack or fault, against a real Mosquitto and a real agent: a corrupt
spool, a garbage epoch file, a loose umask, a full disk. None of them may stop the agent from
starting or leave a QoS 1 request without an answer."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient
from agent.client.reply import AgentError
from agent.config import AgentConfig
from agent.delivery.spool import Spool
from agent.mqtt.epoch import EpochStore, clock_floor
from agent.service.agent import Agent
from tests.conftest import agent_config
from tests.ops_helpers import listen, wait_message, wait_until

Start = Callable[[AgentConfig], Agent]


@pytest.fixture
def start(start_agent: Start) -> Start:
    return start_agent


@pytest.fixture
def client_for(broker: Any) -> Iterator[Callable[[AgentConfig], AgentClient]]:
    clients: list[AgentClient] = []

    def make(config: AgentConfig) -> AgentClient:
        client = AgentClient(
            broker.host,
            broker.port,
            device_id=config.device_id,
            topic_prefix=config.mqtt.topic_prefix,
        ).connect()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def _mlp_ok(client: AgentClient, rows: int = 1) -> None:
    x = np.random.default_rng(0).standard_normal((rows, 16)).astype(np.float32)
    outputs = client.request("mlp", {"x": x}, stream=False, timeout=10).collect()
    assert outputs


# -- a corrupt spool ---------------------------------------------------------------------------


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(64 * 1024))
    path.with_name(path.name + "-wal").write_bytes(os.urandom(4096))


def _page_zeroed(path: Path) -> None:
    spool = Spool(path, max_bytes=1 << 30, max_messages=1 << 20)
    for i in range(300):
        spool.add(f"m/r{i}", "t/x", os.urandom(700), 1, False, None)
    spool.store_request("m/r1", "t/infer/m", b"x" * 100, 1, None, None)
    spool.close()
    (page_size,) = sqlite3.connect(path).execute("PRAGMA page_size").fetchone()
    assert path.stat().st_size > 8 * page_size
    with open(path, "r+b") as f:
        f.seek(page_size)  # page 2: a b-tree page of the schema's first table
        f.write(bytes(page_size))


def _wal_header_lost(path: Path) -> None:
    """A crash with a stored request in the WAL, then the WAL's first page lost: SQLite
    takes such a WAL as empty, and the request was gone without a word."""
    spool = Spool(path, max_bytes=1 << 30, max_messages=1 << 20)
    spool.store_request("m/r1", "t/infer/m", b"x" * 100, 1, None, None)
    crashed = {s: path.with_name(path.name + s).read_bytes() for s in ("", "-wal")}
    spool.close()
    for suffix, data in crashed.items():
        path.with_name(path.name + suffix).write_bytes(data)
    wal = path.with_name(path.name + "-wal")
    assert len(crashed["-wal"]) > 4096
    wal.write_bytes(bytes(4096) + crashed["-wal"][4096:])


@pytest.mark.parametrize(
    "damage",
    [_random_bytes, _page_zeroed, _wal_header_lost],
    ids=["random", "page-zeroed", "wal-header-lost"],
)
def test_a_corrupt_spool_is_moved_aside_and_the_agent_serves(
    broker, repository, tmp_path, start, client_for, damage
):
    config = agent_config(tmp_path, broker, repository)
    assert config.spool.path is not None
    config.spool.path.parent.mkdir(parents=True)
    damage(config.spool.path)
    wal = config.spool.path.with_name(config.spool.path.name + "-wal")
    wal_bytes = wal.read_bytes() if wal.exists() else None
    client = client_for(config)
    events = listen(client, f"{config.root_topic}/events")

    agent = start(config)

    event = wait_message(events, lambda m: m.get("type") == "spool_quarantined", timeout=10)
    moved = Path(event["path"])
    assert moved.exists() and moved.name.startswith("spool.sqlite.corrupt-")
    assert event["reason"]
    if damage is _random_bytes:  # kept, as it was (Python 3.10 had SQLite delete it)
        kept = [p.read_bytes() for p in moved.parent.glob("spool.sqlite.corrupt-*-wal")]
        assert wal_bytes in kept
    assert agent.counters["spool_quarantined"] == 1
    _mlp_ok(client)  # a QoS 1 request, stored in the new spool and answered


def test_a_bad_wal_is_set_aside_and_the_sound_database_kept(tmp_path: Path) -> None:
    """Moving the whole spool aside for a WAL's lost header lost what the database file held,
    checkpointed and sound: the requests stored before the WAL began."""
    path = tmp_path / "spool.sqlite"
    spool = Spool(path, max_bytes=1 << 30, max_messages=1 << 20)
    spool.store_request("m/old", "t/infer/m", b"x" * 100, 1, None, None)
    spool.close()  # checkpointed into the database file
    spool = Spool(path, max_bytes=1 << 30, max_messages=1 << 20)
    spool.store_request("m/new", "t/infer/m", b"y" * 100, 1, None, None)  # in the WAL only
    crashed = {s: path.with_name(path.name + s).read_bytes() for s in ("", "-wal")}
    spool.close()
    for suffix, data in crashed.items():
        path.with_name(path.name + suffix).write_bytes(data)
    wal = path.with_name(path.name + "-wal")
    wal.write_bytes(bytes(4096) + crashed["-wal"][4096:])
    spool = Spool(path, max_bytes=1 << 30, max_messages=1 << 20)
    try:
        assert spool.quarantine is not None and spool.quarantine.path.name.endswith("-wal")
        assert spool.quarantine.path.read_bytes()[4096:] == crashed["-wal"][4096:]
        assert [r.key for r in spool.unfinished_requests()] == ["m/old"]
    finally:
        spool.close()


def test_a_spool_that_cannot_be_opened_is_named_in_the_error(tmp_path):
    """`cannot start: unable to open database file` named neither the file nor the cause."""
    path = tmp_path / "spool.sqlite"
    path.mkdir()  # what SQLite cannot open, as a read-only disk's missing file
    with pytest.raises(sqlite3.OperationalError) as info:
        Spool(path, max_bytes=1 << 20, max_messages=1000)
    assert str(info.value).startswith(f"the spool {path}: unable to open database file")
    assert "full, or read-only?" in str(info.value)


def test_a_spool_that_is_only_locked_is_not_moved_aside(tmp_path):
    """Corruption is moved aside; anything else (here: a write lock held by another process's
    connection) is not a reason to throw a spool away."""
    path = tmp_path / "spool.sqlite"
    Spool(path, max_bytes=1 << 20, max_messages=1000).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError):
            _open_with_short_timeout(path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not list(tmp_path.glob("*.corrupt-*"))


def _open_with_short_timeout(path: Path) -> None:
    from agent.delivery import spool_open

    original = spool_open.connect

    def quick(p: Path) -> sqlite3.Connection:
        return sqlite3.connect(p, isolation_level=None, timeout=0.1)

    spool_open.connect = quick  # type: ignore[assignment]
    try:
        spool_open.open_checked(path, lambda db: None)
    finally:
        spool_open.connect = original  # type: ignore[assignment]


# -- a garbage epoch ---------------------------------------------------------------------------


def _online_epoch(client: AgentClient, config: AgentConfig, above: int) -> int:
    status = listen(client, f"{config.root_topic}/status")
    online = wait_message(
        status, lambda m: m.get("state") == "online" and m["epoch"] > above, timeout=10
    )
    return int(online["epoch"])


@pytest.mark.parametrize("backup", [True, False], ids=["backup-kept", "no-backup"])
def test_a_garbage_epoch_file_never_moves_the_epoch_backwards(
    broker, repository, tmp_path, start, client_for, backup
):
    config = agent_config(tmp_path, broker, repository)
    client = client_for(config)
    first = start(config)
    before = first.epoch
    assert before >= 1
    first.stop()
    epoch_file = config.state_dir / "epoch"
    epoch_file.write_bytes(b"\x00\xffnot a number\n")
    if not backup:  # the state an older agent left: one copy only
        (config.state_dir / "epoch.backup").unlink()
    events = listen(client, f"{config.root_topic}/events")

    again = start(config)

    event = wait_message(events, lambda m: m.get("type") == "epoch_recovered", timeout=10)
    assert event["source"] == ("backup" if backup else "clock")
    assert again.epoch > before
    assert _online_epoch(client, config, before) == again.epoch  # the retained status
    if backup:
        assert again.epoch == before + 1
    assert int(epoch_file.read_text()) == again.epoch  # rewritten


def test_epoch_recovery_waits_for_a_plausible_clock(tmp_path: Path):
    now = [0.0]  # a box that booted in 1970
    path = tmp_path / "epoch"
    path.write_text("garbage")
    store = EpochStore(path, clock=lambda: now[0])
    assert store.recovery is not None and store.recovery.source == "none"
    assert store.next() == 1
    now[0] = 1_800_000_000.0  # NTP ran
    floor = clock_floor(now[0])
    assert floor is not None and store.next() == floor + 1
    store.commit(store.next())
    assert EpochStore(path).value == floor + 1 and EpochStore(path).recovery is None


def test_the_epoch_on_disk_keeps_up_on_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk took no new file, so the epoch announced went on in memory alone, and the
    next start went back below it (a monitor then ignores the live agent's `online`)."""
    from agent.mqtt import epoch as epoch_module

    path = tmp_path / "epoch"
    store = EpochStore(path)
    store.commit(store.next())  # written as usual once

    def full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(epoch_module, "write_atomic", full)
    for _ in range(3):
        store.commit(store.next())
    monkeypatch.undo()
    assert store.value == 4
    assert EpochStore(path).value == 4
    path.unlink()  # the backup copy too
    assert EpochStore(path).value == 4


def test_the_highest_readable_copy_wins(tmp_path: Path):
    path = tmp_path / "epoch"
    store = EpochStore(path)
    store.commit(7)
    path.write_text("3\n")  # an older copy restored by hand
    assert EpochStore(path).value == 7
    (tmp_path / "epoch.backup").write_text("")  # a lost write
    assert EpochStore(path).value == 3


# -- modes -------------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["022", "000"])
def test_state_files_are_private_whatever_the_umask(
    broker, repository, tmp_path, start, client_for, umask
):
    config = agent_config(tmp_path, broker, repository)
    old = os.umask(umask)
    try:
        agent = start(config)
        _mlp_ok(client_for(config))
        state = config.state_dir
        assert _mode(state) == 0o700
        spool = config.spool.path
        assert spool is not None
        for name in (spool.name, f"{spool.name}-wal", f"{spool.name}-shm", "epoch", "epoch.backup"):
            assert (state / name).exists(), name
            assert _mode(state / name) == 0o600, name
        assert agent.spool is not None
    finally:
        os.umask(old)


def test_loose_state_is_tightened(broker, repository, tmp_path, start):
    config = agent_config(tmp_path, broker, repository)
    state = config.state_dir
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    (state / "epoch").write_text("5\n")
    os.chmod(state / "epoch", 0o644)
    agent = start(config)
    assert _mode(state) == 0o700
    assert _mode(state / "epoch") == 0o600
    assert agent.epoch == 6


# -- a full disk -------------------------------------------------------------------------------


def _healthz(agent: Agent) -> tuple[bool, dict[str, Any]]:
    assert agent.metrics_server is not None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{agent.metrics_server.url}/healthz", timeout=5) as response:
            return True, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return False, json.loads(e.read())


def _overloaded(client: AgentClient) -> AgentError:
    x = np.ones((1024, 16), dtype=np.float32)  # 64 KB: new pages in the spool
    with pytest.raises(AgentError) as caught:
        client.request("mlp", {"x": x}, stream=False, timeout=10).collect()
    assert caught.value.code == "overloaded"
    return caught.value


def _first_request_while_full(client: AgentClient) -> None:
    """The request that finds the disk full: answered from memory if its reply was out before
    its store failed, else `overloaded`; either way, answered."""
    x = np.ones((1024, 16), dtype=np.float32)
    try:
        client.request("mlp", {"x": x}, stream=False, timeout=10).collect()
    except AgentError as e:
        assert e.code == "overloaded"


def _full_then_free(agent: Agent, client: AgentClient, free: Callable[[], None]) -> None:
    _first_request_while_full(client)
    assert wait_until(lambda: not _healthz(agent)[0], timeout=10)
    _, details = _healthz(agent)
    assert "disk is full" in str(details["problem"])
    error = _overloaded(client)
    assert "disk is full" in str(error)
    assert agent.counters["requests_store_failed"] >= 1
    free()
    assert wait_until(lambda: _healthz(agent)[0], timeout=10)
    _mlp_ok(client, rows=1024)


def test_disk_full_by_max_page_count(broker, repository, tmp_path, start, client_for):
    """The spool's own limit (PRAGMA max_page_count) makes SQLite raise SQLITE_FULL exactly
    as a full file system does: the same path, without a mount."""
    config = agent_config(tmp_path, broker, repository)
    agent = start(config)
    client = client_for(config)
    _mlp_ok(client)
    spool = agent.spool
    assert spool is not None

    def limit(pages: int | None) -> None:
        with spool._lock:
            if pages is None:
                (pages,) = spool._db.execute("PRAGMA page_count").fetchone()
            spool._db.execute(f"PRAGMA max_page_count={pages}")

    limit(None)
    _full_then_free(agent, client, lambda: limit(1 << 30))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_on_a_full_file_system(
    broker, repository, tmp_path, start, client_for, small_tmpfs
):
    config = agent_config(tmp_path, broker, repository)
    config = config.model_copy(
        update={
            "state_dir": small_tmpfs / "state",
            "spool": config.spool.model_copy(
                update={"path": small_tmpfs / "state" / "spool.sqlite"}
            ),
        }
    )
    agent = start(config)
    client = client_for(config)
    _mlp_ok(client)
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(bytes(64 * 1024))
                f.flush()
        except OSError:
            pass
    _full_then_free(agent, client, filler.unlink)
