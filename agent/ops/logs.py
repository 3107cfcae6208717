"""Logging for a daemon under systemd: one line per event, journald levels, no secrets.

* **One line per event.** JSON lines escape newlines by nature; text lines write a message's
  or traceback's newlines as `\\n` unless stderr is a terminal (a person reading), so journald
  and log shippers never split one event into many records.
* **journald levels.** When stderr is the journal (`$JOURNAL_STREAM` names it), every line
  starts with the syslog priority (`<3>` error ... `<7>` debug), which journald strips and
  stores as PRIORITY, so `journalctl -p warning` works; the timestamp is left to journald.
* **Truncation.** A message longer than `MAX_MESSAGE_CHARS` is cut with a note of how much was
  left out: a payload logged by mistake cannot flood the journal.
* **Redaction.** `RedactFilter` sits on the handler, so every record of every logger passes
  it: the MQTT password (the password file's content) and the paths of secret files are
  replaced by `***`, as `check-config` masks them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from agent.config import SECRET_MASK, AgentConfig
from agent.config.printing import url_secrets

MAX_MESSAGE_CHARS = 4000
# sd-daemon(3) prefixes: what journald turns into PRIORITY=.
_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"
JOURNAL_TEXT_FORMAT = "%(levelname)s %(name)s [%(threadName)s] %(message)s"


def priority(levelno: int) -> int:
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


def stream_is_journal(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """True when `stream` is the journal: `$JOURNAL_STREAM` is its `device:inode`."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, _, inode = value.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return bool(inode) and st.st_dev == int(device) and st.st_ino == int(inode)
    except (OSError, ValueError, AttributeError):
        return False


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what journald and log shippers parse best."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "thread": record.threadName,
            "msg": truncate(record.getMessage()),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        line = json.dumps(entry, ensure_ascii=False, default=str)
        return f"<{priority(record.levelno)}>{line}" if self.journal else line


class TextFormatter(logging.Formatter):
    """`time LEVEL logger [thread] message`; one line unless a person reads a terminal."""

    def __init__(self, journal: bool = False, multiline: bool = False) -> None:
        super().__init__(JOURNAL_TEXT_FORMAT if journal else TEXT_FORMAT)
        self.journal = journal
        self.multiline = multiline

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = truncate(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.multiline:
            text = text.replace("\r", "").replace("\n", "\\n")
        return f"<{priority(record.levelno)}>{text}" if self.journal else text


class RedactFilter(logging.Filter):
    """Replaces every known secret in a record (message, arguments, traceback) with `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets: list[str] = []
        self.set_secrets(secrets)

    def set_secrets(self, secrets: Iterable[str]) -> None:
        # Longest first, so a path is masked whole before a shorter secret inside it.
        self.secrets = sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, SECRET_MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: logging reports it, we must not hide it
            return True
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        return True


def config_secrets(config: AgentConfig) -> list[str]:
    """What must never reach a log: the password itself, the paths of secret files, and the
    secrets in sources' URLs.

    The password is read from its file here, once, only to know what to mask; an unreadable
    file simply contributes its path.
    """
    secrets: list[str] = []
    mqtt = config.mqtt
    paths: list[Path] = [p for p in (mqtt.password_file, mqtt.tls.key_file) if p is not None]
    secrets += [str(path) for path in paths]
    if mqtt.password_file is not None:
        try:
            password = mqtt.password_file.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError):  # refused where it is read for a connection
            password = ""
        secrets.append(password)
    for source in config.sources:  # a camera's password, a token in its URL
        if source.url is not None:
            secrets += url_secrets(str(source.url))
    return secrets


_redact = RedactFilter()
_current: dict[str, Any] = {}  # what setup_logging last installed: format, stream, handler


def setup_logging(
    level: str, fmt: str, *, secrets: Iterable[str] = (), stream: TextIO | None = None
) -> logging.Handler:
    """One handler on the root logger; calling it again (SIGHUP) replaces it."""
    out = stream or sys.stderr
    journal = stream_is_journal(out)
    handler = logging.StreamHandler(out)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(journal=journal))
    else:
        multiline = not journal and hasattr(out, "isatty") and out.isatty()
        handler.setFormatter(TextFormatter(journal=journal, multiline=multiline))
    _redact.set_secrets(secrets)
    handler.addFilter(_redact)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("paho").setLevel(logging.WARNING)
    _current.update(format=fmt, stream=out, handler=handler)
    threading.excepthook = _log_thread_death
    return handler


def _log_thread_death(args: threading.ExceptHookArgs) -> None:
    """A thread's uncaught exception as one log record (formatted, redacted), not Python's
    raw traceback on stderr; the health check reports the dead thread."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    exc_info = (args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
    logging.getLogger("agent").critical("the %s thread died", name, exc_info=exc_info)


def reconfigure(level: str, fmt: str) -> None:
    """SIGHUP: a new level at once; a new format replaces the handler (same stream, secrets).

    Does nothing to the format where `setup_logging` never ran (an agent embedded in another
    program, or the tests, keeps the host's handlers).
    """
    logging.getLogger().setLevel(level.upper())
    handler = _current.get("handler")
    if handler is None or fmt == _current.get("format"):
        return
    if handler in logging.getLogger().handlers:
        setup_logging(level, fmt, secrets=_redact.secrets, stream=_current["stream"])


def add_secrets(secrets: Iterable[str]) -> None:
    """A reload may name new secret files; the old values stay masked too."""
    _redact.set_secrets([*_redact.secrets, *secrets])


def redact(text: str) -> str:
    """Mask the configured secrets in `text` (for output that bypasses logging)."""
    return _redact.redact(text)
