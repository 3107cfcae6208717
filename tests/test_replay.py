"""Requests stored before a crash and run again at the next start: a spool that cannot be
written when the replay comes (a full or read-only disk) delays it, never loses it; a
replayed request that fails ends with an `error` a deduplicating subscriber keeps."""

from __future__ import annotations

import contextlib
import queue
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.client import AgentClient
from agent.delivery.spool import Spool
from agent.mqtt.messages import Incoming
from agent.protocol.payload import encode_payload
from agent.protocol.replies import reply_envelope
from tests.conftest import agent_config, write_long_decoder
from tests.ops_helpers import wait_until


def _stored(
    config: Any, model: str, request_id: str, steps: int = 3, began_on: int | None = None
) -> None:
    """A QoS 1 request stored in the agent's spool with no terminal message, as a crash
    leaves it; `began_on`: its stream's first chunk, from that version, went out before."""
    root = f"{config.mqtt.topic_prefix}/{config.device_id}"
    body = {
        "id": request_id,
        "inputs": {"token": np.array([[1]], np.int64)},
        "params": {"max_steps": steps},
    }
    spool = Spool(config.spool.path, max_bytes=1 << 24, max_messages=1000)
    key = f"{model}/{request_id}"
    try:
        assert spool.store_request(
            key, f"{root}/infer/{model}", encode_payload(body), 1, None, None
        )
        if began_on is not None:
            chunk = reply_envelope(
                request_id=request_id, seq=0, type="chunk", model=model, version=began_on
            )
            topic = f"{root}/result/{model}/{request_id}"
            spool.add(key, topic, encode_payload(chunk), 1, False, None, rid=request_id, seq=0)
    finally:
        spool.close()


@pytest.fixture
def listen(broker) -> Any:
    """`listen(config, topic)`: the messages on ROOT/`topic`, subscribed before the agent
    starts (a replay runs at its first connection)."""
    clients: list[AgentClient] = []

    def subscribe(config: Any, topic: str) -> queue.Queue[dict[str, Any]]:
        client = AgentClient(broker.host, broker.port, device_id=config.device_id).connect()
        clients.append(client)
        messages: queue.Queue[dict[str, Any]] = queue.Queue()
        client.listen(f"{client.root}/{topic}", lambda t, m, raw: messages.put(m or {}))
        time.sleep(0.1)  # subscribed
        return messages

    yield subscribe
    for client in clients:
        client.close()


def test_a_replay_the_spool_cannot_write_runs_once_the_disk_takes_writes(
    broker, tmp_path: Path, start_agent, listen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was tried once, at the first CONNACK: a failed write lost it until a restart."""
    repository = write_long_decoder(tmp_path / "models")
    config = agent_config(tmp_path, broker, repository)
    _stored(config, "decoder", "early")
    _stored(config, "decoder", "later")
    failures = {"left": 3}
    drop_stream = Spool.drop_stream

    def full_disk(self: Spool, stream: str) -> int:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise sqlite3.OperationalError("database or disk is full")
        return drop_stream(self, stream)

    monkeypatch.setattr(Spool, "drop_stream", full_disk)
    replies = listen(config, "result/decoder/+")
    start_agent(config)
    terminals: dict[str, list[dict[str, Any]]] = {}
    deadline = time.monotonic() + 15
    while len(terminals) < 2 and time.monotonic() < deadline:
        try:
            message = replies.get(timeout=1)
        except queue.Empty:
            continue
        if message["type"] != "chunk":
            terminals.setdefault(message["id"], []).append(message)
    assert failures["left"] == 0
    assert sorted(terminals) == ["early", "later"]
    assert all(len(ends) == 1 and ends[0]["type"] == "end" for ends in terminals.values())
    time.sleep(1.5)  # later ticks run nothing again
    assert [m for m in list(replies.queue) if m["type"] != "chunk"] == []


def test_a_replay_runs_on_the_version_its_stream_began_on(
    broker, tmp_path: Path, start_agent, listen
) -> None:
    """A version swapped in before the crash made one stream of two versions' messages: the
    replay is pinned to the version its first messages came from; that one unloaded since
    (v1: only the serving version loads at a start), it ends in an error, not in tokens no
    model made."""
    repository = write_long_decoder(tmp_path / "models")
    shutil.copytree(repository / "decoder" / "1", repository / "decoder" / "2")
    config = agent_config(tmp_path, broker, repository)
    _stored(config, "decoder", "on-v2", began_on=2)
    _stored(config, "decoder", "on-v1", began_on=1)
    _stored(config, "decoder", "not-begun")
    replies = listen(config, "result/decoder/+")
    agent = start_agent(config)
    assert agent.models.inventory()["models"]["decoder"]["serving"] == 2
    ends: dict[str, dict[str, Any]] = {}
    chunk_versions: dict[str, set[int]] = {}
    while len(ends) < 3:
        message = replies.get(timeout=10)
        if message["type"] != "chunk":
            ends[message["id"]] = message
        else:
            chunk_versions.setdefault(message["id"], set()).add(message["version"])
    # (a chunk spooled before the crash may go out again first, then the run's own)
    assert chunk_versions["on-v2"] == chunk_versions["not-begun"] == {2}
    assert chunk_versions.get("on-v1", {1}) == {1}
    assert ends["on-v2"]["type"] == ends["not-begun"]["type"] == "end"
    assert ends["on-v1"]["type"] == "error" and ends["on-v1"]["code"] == "unknown_version"
    assert ends["on-v1"]["seq"] is None


def test_a_replayed_request_that_fails_ends_with_an_error_outside_the_numbering(
    broker, tmp_path: Path, start_agent, listen
) -> None:
    """Its seq 0 may have reached the subscriber before the crash: an `error` at seq 0 was
    dropped as a duplicate, and the stream never ended for it."""
    repository = write_long_decoder(tmp_path / "models")
    config = agent_config(tmp_path, broker, repository)
    _stored(config, "gone-model", "orphan")
    replies = listen(config, "result/gone-model/orphan")
    start_agent(config)
    message = replies.get(timeout=10)
    assert message["type"] == "error" and message["code"] == "unknown_model"
    assert message["seq"] is None


def test_a_redelivered_request_that_fails_ends_with_an_error_outside_the_numbering(
    broker, tmp_path: Path, start_agent, listen
) -> None:
    """The broker redelivers (DUP) a request the agent ran but had not acknowledged when it
    crashed: the subscriber holds its first seqs, so an `error` at seq 0 was dropped."""
    repository = write_long_decoder(tmp_path / "models")
    config = agent_config(tmp_path, broker, repository)
    replies = listen(config, "result/moved/again")
    agent = start_agent(config)
    body = {"id": "again", "inputs": {"token": np.array([[1]], np.int64)}}
    topic = f"{agent.root}/infer/moved"  # its model's folder not there (yet) after the restart
    agent.ingress.on_message(Incoming(topic, encode_payload(body), 0, dup=True))
    message = replies.get(timeout=10)
    assert message["type"] == "error" and message["code"] == "unknown_model"
    assert message["seq"] is None


def test_a_request_stored_while_the_replay_waits_runs_once(
    broker, tmp_path: Path, start_agent, listen, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay, retried, ran every unfinished stored request: a live one stored while it
    waited for the disk ran a second time (two `end`s for one id)."""
    repository = write_long_decoder(tmp_path / "models")
    config = agent_config(tmp_path, broker, repository)
    _stored(config, "decoder", "old")
    disk = {"full": True}
    drop_stream = Spool.drop_stream

    def full_disk(self: Spool, stream: str) -> int:
        if disk["full"]:
            raise sqlite3.OperationalError("database or disk is full")
        return drop_stream(self, stream)

    monkeypatch.setattr(Spool, "drop_stream", full_disk)
    replies = listen(config, "result/decoder/+")
    agent = start_agent(config)
    client = AgentClient(broker.host, broker.port, device_id=config.device_id).connect()
    try:
        body = {"id": "live", "inputs": {"token": np.array([[1]], np.int64)}}
        body["params"] = {"max_steps": 2000}
        client.publish_raw(f"{client.root}/infer/decoder", encode_payload(body), 1)
        assert wait_until(lambda: "decoder/live" in _stored_keys(agent), 5)
        disk["full"] = False  # the next tick's replay goes through
        ends: dict[str, list[str]] = {}
        deadline = time.monotonic() + 20
        while ends.keys() != {"old", "live"} and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                message = replies.get(timeout=0.5)
                if message["type"] != "chunk":
                    ends.setdefault(message["id"], []).append(message["type"])
        time.sleep(1.5)  # a second run of `live` would end by now
        rest = [m for m in list(replies.queue) if m["type"] != "chunk"]
        assert ends == {"old": ["end"], "live": ["end"]} and rest == []
    finally:
        client.close()


def _stored_keys(agent: Any) -> list[str]:
    return [r.key for r in agent.spool.unfinished_requests()]
