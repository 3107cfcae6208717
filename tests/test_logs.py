"""Log lines: one per event, journald priorities, truncation, and secrets masked."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import load_config
from agent.ops import logs


@pytest.fixture
def restore_root() -> Iterator[None]:
    """setup_logging replaces the root handlers (and the threads' excepthook): put pytest's
    back afterwards."""
    root = logging.getLogger()
    handlers, level, hook = root.handlers[:], root.level, threading.excepthook
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    threading.excepthook = hook


def _emit(stream: io.StringIO, fmt: str, secrets: list[str]) -> list[str]:
    logs.setup_logging("debug", fmt, secrets=secrets, stream=stream)
    log = logging.getLogger("agent.test")
    log.info("connecting with password %s", secrets[0])
    log.warning("cannot read password file %s: Permission denied", secrets[1])
    try:
        raise ConnectionError(f"auth failed for {secrets[0]}")
    except ConnectionError:
        log.exception("mqtt: handler failed\nsecond line")
    log.debug("payload %s", "x" * 10_000)
    return stream.getvalue().splitlines()


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_one_line_per_event_and_secrets_masked(fmt, restore_root):
    secrets = ["s3cr3t-pass", "/run/credentials/edge-agent.service/mqtt-password"]
    lines = _emit(io.StringIO(), fmt, secrets)
    assert len(lines) == 4  # the traceback and the embedded newline stay on their event's line
    text = "\n".join(lines)
    for secret in secrets:
        assert secret not in text
    assert text.count("***") >= 3
    assert "10000" not in text and "more characters" in lines[3]
    assert len(lines[3]) < logs.MAX_MESSAGE_CHARS + 500
    if fmt == "json":
        entries = [json.loads(line) for line in lines]
        assert [e["level"] for e in entries] == ["info", "warning", "error", "debug"]
        assert "ConnectionError: auth failed for ***" in entries[2]["exc"]
    else:
        assert " ERROR agent.test [" in lines[2] and "\\nTraceback" in lines[2]


def test_a_thread_that_dies_is_one_redacted_log_line(restore_root):
    """Not Python's raw traceback on stderr, where the secret filter does not reach."""
    stream = io.StringIO()
    logs.setup_logging("info", "json", secrets=["s3cr3t-pass"], stream=stream)

    def fail() -> None:
        raise OSError("cannot read s3cr3t-pass")

    thread = threading.Thread(target=fail, name="mqtt-io")
    thread.start()
    thread.join()
    (line,) = stream.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["level"] == "critical" and entry["msg"] == "the mqtt-io thread died"
    assert "OSError: cannot read ***" in entry["exc"] and "s3cr3t" not in line


def test_journald_gets_syslog_priorities_and_no_timestamp(tmp_path, restore_root, monkeypatch):
    path = tmp_path / "journal"
    with open(path, "w+") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert logs.stream_is_journal(stream)
        logs.setup_logging("debug", "text", stream=stream)
        log = logging.getLogger("agent.test")
        log.error("broken")
        log.warning("odd")
        log.info("fine")
        log.debug("detail")
        stream.flush()
    lines = path.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<3>", "<4>", "<6>", "<7>"]
    assert lines[0] == "<3>ERROR agent.test [MainThread] broken"
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    assert not logs.stream_is_journal(io.StringIO())


def test_reconfigure_changes_level_and_format(restore_root):
    stream = io.StringIO()
    logs.setup_logging("info", "text", stream=stream)
    log = logging.getLogger("agent.test")
    log.debug("hidden")
    logs.reconfigure("debug", "json")
    log.debug("shown")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["msg"] == "shown"


def test_config_secrets_reads_the_password_to_mask_it(tmp_path: Path):
    (tmp_path / "pw").write_text("p4ssw0rd\n")
    path = tmp_path / "agent.toml"
    path.write_text(
        '[mqtt]\nusername = "u"\npassword_file = "pw"\n[mqtt.tls]\nkey_file = "/k/client.key"\n'
    )
    secrets = logs.config_secrets(load_config(path, {}))
    assert set(secrets) == {"p4ssw0rd", str(tmp_path / "pw"), "/k/client.key"}
