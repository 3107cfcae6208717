"""What a source counts (`Stats`: what /health and Prometheus show) and how it bears the
failures of its frames and records (`FrameErrors`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from agent.models.backends.base import InferenceError
from agent.sources.base import SourceError
from agent.sources.frames import Frame

log = logging.getLogger(__name__)

CONSECUTIVE_ERRORS_TO_FAIL = 20  # frames in a row that fail: the source is reopened
CONSECUTIVE_BAD_RECORDS_TO_FAIL = 100
ERROR_LOG_INTERVAL_S = 10.0


@dataclass
class Stats:
    """A source's counters; written by its thread and the workers, read at /health and at
    scrape time (plain ints: a read may be a frame behind, never torn)."""

    frames: int = 0  # read from the source
    published: int = 0  # results handed to the outbox
    messages: int = 0  # stream messages (parts count one each)
    dropped: int = 0  # replaced by a newer frame (latest)
    errors: int = 0  # frames that failed (bad input, model error, no model)
    bad_inputs: int = 0  # of which: the input was unusable
    failures: int = 0  # times the source itself failed and was retried
    queue_full: int = 0  # the scheduler queue had no room for the source's ticket
    latency_s: float = 0.0  # last frame: capture to outbox
    infer_s: float = 0.0  # last frame: in the model
    max_pending: int = 0


class FrameErrors:
    """The errors of one source's frames and records, on its thread and on the workers.

    Each costs one error, never the source, and is logged at a bounded rate, so a broken input
    cannot flood the log. Only a run of them in a row means the source itself is broken (a
    camera sending garbage, a model failing every frame): bad records then raise SourceError
    on the source thread, and failing frames set `trouble`, which the source thread raises;
    either way the source is reopened with backoff.
    """

    def __init__(self, name: str, stats: Stats) -> None:
        self.name = name
        self.stats = stats
        self.last_error: str | None = None
        self.trouble: str | None = None  # set by workers: too many failing frames
        self.consecutive = 0  # frames in a row that failed
        self._bad_records_in_row = 0
        self._last_log = 0.0
        self._unlogged = 0

    def bad_record(self, message: str) -> None:
        """A file or record that could not be read: one error, never the source."""
        self.stats.errors += 1
        self.stats.bad_inputs += 1
        self.log(message)

    def bad_streak(self, error: str) -> None:
        self._bad_records_in_row += 1
        if self._bad_records_in_row >= CONSECUTIVE_BAD_RECORDS_TO_FAIL:
            self._bad_records_in_row = 0
            raise SourceError(f"{CONSECUTIVE_BAD_RECORDS_TO_FAIL} bad records in a row: {error}")

    def good_streak(self) -> None:
        self._bad_records_in_row = 0

    def frame_failed(
        self, frame: Frame, message: str, *, bad_input: bool = False, retry: bool = False
    ) -> None:
        self.stats.errors += 1
        if bad_input:
            self.stats.bad_inputs += 1
        self.last_error = message
        where = f"file {frame.record.file}" if frame.record.file else f"frame {frame.index}"
        self.log(f"{where}: {message}")
        frame.finish("retry" if retry else "failed")
        self.consecutive += 1
        if self.consecutive >= CONSECUTIVE_ERRORS_TO_FAIL:
            self.consecutive = 0
            self.trouble = f"{CONSECUTIVE_ERRORS_TO_FAIL} frames in a row failed: {message}"

    def model_failed(self, frame: Frame, error: Exception, index: int) -> None:
        """(In an `except` block) a run of the model on frame `index` raised: an
        InferenceError is the input's doing; anything else is logged with its traceback."""
        if isinstance(error, InferenceError):
            self.frame_failed(frame, f"model_error: {error}", bad_input=True)
        else:
            log.exception("source %s: the model failed on frame %d", self.name, index)
            self.frame_failed(frame, f"model_error: {type(error).__name__}: {error}")

    def log(self, message: str) -> None:
        """The first error at once, then at most one line every ERROR_LOG_INTERVAL_S."""
        now = time.monotonic()
        self._unlogged += 1
        if now - self._last_log >= ERROR_LOG_INTERVAL_S:
            more = self._unlogged - 1
            suffix = f" ({more} more since the last report)" if more else ""
            log.warning("source %s: %s%s", self.name, message[:300], suffix)
            self._last_log = now
            self._unlogged = 0
