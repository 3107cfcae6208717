"""What every part of agent.sources shares: the record a reader makes, the reader protocol,
the errors, how a source's place is named."""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agent.config import SourceConfig
from agent.config.printing import safe_url
from agent.models.backends.base import Array
from agent.models.resize import Geometry
from agent.protocol.errors import Limits

FIELD = "frame"  # the field a video frame, an image or a .npy file arrives as

Outcome = Literal["done", "failed", "retry", "dropped"]


def describe_where(config: SourceConfig) -> str:
    """Where a source reads, for its logs and errors: the camera, the command, the path or the
    URL."""
    if config.command is not None:
        return f"command {shlex.join(config.command)}"
    if config.device is not None:
        return f"camera {config.device}"
    if config.path is not None:
        return str(config.path)
    return safe_url(str(config.url))  # its password and query masked


class SourceError(Exception):
    """The source cannot go on (cannot open, stream lost, broken input): retried later."""


class FramingError(ValueError):
    """The bytes of a pipe are not a CBOR sequence the limits allow."""


@dataclass
class Record:
    """What a reader produced: fields by name, or `error` for a record it could not use."""

    fields: dict[str, Array]
    bgr: bool = False  # OpenCV's channel order (video frames, decoded images)
    prepared: bool = False  # already the model's inputs (synthetic tensors)
    file: str | None = None  # folder: the file's name, sent as `file`
    on_done: Callable[[Outcome], None] | None = None
    error: str | None = None
    extra: dict[str, Any] | None = None  # more fields of its stream message (pcm: `offset`)
    geometry: Geometry | None = None  # where preprocessed: for `[[postprocess]]` boxes
    count: int = 1  # frames it stands for, each its own stream message and index (pcm: chunks)

    def chunk_extra(self, chunk: int) -> dict[str, Any] | None:
        """More fields of the stream message of its frame `chunk` (0 .. count - 1)."""
        return self.extra

    def first(self, count: int) -> Record:
        """The record cut to its first `count` frames (a source's `max_frames`)."""
        return self

    def rest(self, chunk: int) -> Record:
        """The record from its frame `chunk` on (the frames a worker left for later)."""
        return self


class ReaderContext(Protocol):
    """What a reader needs from its runner."""

    config: SourceConfig
    limits: Limits
    stop_event: threading.Event

    def idle(self) -> None:
        """Called while a reader waits, so a ticket refused by a full queue is retried."""


class Reader(Protocol):
    def records(self) -> Iterator[Record]:
        """Blocks for each record; returns at the end of the source; raises SourceError."""
        ...

    def close(self) -> None: ...
