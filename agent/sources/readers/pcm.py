"""The pcm source's reading side: raw interleaved samples from a command's standard output, a
FIFO or a file, converted to float32 and cut into the model's windows (agent.sources.pcm runs
them).

Samples arrive in whatever blocks the pipe gives; a sample frame cut between two reads is
kept until it is complete. The windows of one opening are numbered from offset 0, and the
first record of an opening is `fresh`: the worker starts the carried state again from zeros.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from agent.inference.windows import Windower
from agent.models.backends.base import Array
from agent.sources.base import ReaderContext, Record, SourceError

log = logging.getLogger(__name__)

READ_BLOCK = 64 * 1024  # bytes a read: 2 s of 16 kHz mono s16, or less when less is there
# Chunks one record carries at most: all a read made complete, up to this many, go to a worker
# as one frame of the source (one hand-over between the threads, one lease of the model) and
# are run and published one chunk after the other (docs/decisions/0035).
RECORD_CHUNKS = 16
POLL_MS = 200  # the reader looks at the stop flag this often while nothing arrives
STDERR_KEPT = 2048  # the command's last words, for the error when it exits
EXIT_WAIT_S = 2.0  # after its stdout closed, how long the command may take to exit
SAMPLE: dict[str, np.dtype[Any]] = {"s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}


@dataclass(frozen=True)
class WindowPlan:
    """How the source's samples become the model's windows (from its `[scan]`, checked by
    agent.sources.pcm when the source opens)."""

    input: str  # the model input a window feeds
    window: int
    hop: int
    lead: int
    tail: Literal["drop", "pad"]
    per_chunk: int  # windows a record (and a stream message) carries
    mono_rank1: bool  # the input is [samples]: a mono window without its batch axis


@dataclass
class PcmRecord(Record):
    """The windows one read made complete: `count` chunks of `plan.per_chunk` windows each
    (the last fewer at the end of a stream), their stream messages numbered one a chunk;
    `fresh` on the first of an opening: the state carried through the windows starts again
    from zeros."""

    plan: WindowPlan | None = None
    fresh: bool = False

    def windows(self, chunk: int) -> Array:
        """The windows of chunk `chunk` (0 .. count - 1) of this record."""
        return self._chunks(chunk, chunk + 1)

    def _chunks(self, start: int, end: int | None) -> Array:
        """The windows of chunks `start` .. `end` - 1 (None: to the last)."""
        assert self.plan is not None
        per_chunk = self.plan.per_chunk
        stop = None if end is None else end * per_chunk
        windows: Array = self.fields[self.plan.input][start * per_chunk : stop]
        return windows

    def chunk_extra(self, chunk: int) -> dict[str, Any] | None:
        """`offset` of the chunk's first window: the record's, one hop a window further."""
        assert self.plan is not None and self.extra is not None
        offset = int(self.extra["offset"]) + chunk * self.plan.per_chunk * self.plan.hop
        return {**self.extra, "offset": offset}

    def rest(self, chunk: int) -> PcmRecord:
        """The record from its chunk `chunk` on (the chunks a worker left for later)."""
        assert self.plan is not None
        return replace(
            self,
            fields={self.plan.input: self._chunks(chunk, None)},
            extra=self.chunk_extra(chunk),
            count=self.count - chunk,
            fresh=False,
        )

    def first(self, count: int) -> PcmRecord:
        """The record cut to its first `count` chunks (a source's `max_frames`)."""
        if count >= self.count:
            return self
        assert self.plan is not None
        return replace(self, fields={self.plan.input: self._chunks(0, count)}, count=count)


def to_float(data: bytes | memoryview, fmt: str, channels: int) -> Array:
    """Whole sample frames of interleaved `fmt` as float32 [channels, n] in [-1, 1)."""
    raw = np.frombuffer(data, dtype=SAMPLE[fmt])
    if fmt == "s16le":
        samples = raw.astype(np.float32) * np.float32(1 / 32768)
    else:
        samples = raw.astype(np.float32)
    return np.ascontiguousarray(samples.reshape(-1, channels).T)


class PcmReader:
    """Raw samples from `command`'s stdout, a FIFO or a file, as records of windows.

    Memory stays bounded: a read is at most READ_BLOCK bytes, the windower keeps less than a
    window, and the runner's queue (`policy = "all"`) blocks this thread when the model is
    behind, which stops reading and so pushes back on the writer (a microphone's recorder
    then drops samples itself; arecord says "overrun").
    """

    def __init__(self, ctx: ReaderContext, plan: WindowPlan) -> None:
        self.ctx = ctx
        self.plan = plan
        config = ctx.config
        assert config.format is not None and config.channels is not None
        self.format = config.format
        self.channels = config.channels
        self.frame_bytes = SAMPLE[config.format].itemsize * config.channels
        self.process: subprocess.Popen[bytes] | None = None
        self.fd = -1
        self.fifo = False
        self._stderr = bytearray()
        self._open()

    # -- opening and closing ---------------------------------------------------------------

    def _open(self) -> None:
        command = self.ctx.config.command
        if command is not None:
            self._start(command)
            return
        path = self.ctx.config.path
        assert path is not None
        try:
            self.fifo = stat.S_ISFIFO(path.stat().st_mode)
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise SourceError(f"cannot open {path}: {e.strerror or e}") from None

    def _start(self, command: list[str]) -> None:
        try:
            self.process = subprocess.Popen(  # its own process group: `close` ends all of it
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise SourceError(f"cannot start {command[0]}: {e.strerror or e}") from None
        assert self.process.stdout is not None and self.process.stderr is not None
        self.fd = self.process.stdout.fileno()
        os.set_blocking(self.fd, False)
        os.set_blocking(self.process.stderr.fileno(), False)

    def close(self) -> None:
        """Stop the command and whatever it started (its process group: a wrapper script's
        children too; TERM, then KILL) and close what is open."""
        process, self.process = self.process, None
        if process is not None:
            _signal_group(process, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(EXIT_WAIT_S)
            _signal_group(process, signal.SIGKILL)  # what is left of it
            process.wait()
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        elif self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    # -- reading ---------------------------------------------------------------------------

    def records(self) -> Iterator[Record]:
        while True:
            yield from self._one_opening()
            if self.ctx.stop_event.is_set():
                return
            if self.process is not None:
                raise SourceError(self._exited())
            if not self.fifo:
                return  # a file read to its end: the source is finished
            self.close()  # every writer of the FIFO closed: wait for the next one
            self._open()

    def _one_opening(self) -> Iterator[PcmRecord]:
        """The windows of everything read until the end of the stream, offsets from 0: after
        each read, the whole chunks it completed, up to RECORD_CHUNKS a record."""
        plan = self.plan
        windower = Windower(plan.window, plan.hop, plan.lead)
        group: list[tuple[int, Array]] = []
        leftover = b""
        for data in self._blocks():
            data = leftover + data if leftover else data
            usable = len(data) - len(data) % self.frame_bytes
            leftover = bytes(data[usable:])
            if usable:
                view = memoryview(data)[:usable]
                group.extend(windower.push(to_float(view, self.format, self.channels)))
                whole = len(group) - len(group) % plan.per_chunk
                yield from self._records(group[:whole])
                del group[:whole]
        if self.ctx.stop_event.is_set():
            return  # stopping: the tail is not worth a window
        if leftover:
            log.info(
                "source %s: %d byte(s) of a cut sample frame dropped at the end",
                self.ctx.config.name,
                len(leftover),
            )
        group.extend(windower.finish(plan.tail))
        yield from self._records(group)

    def _records(self, group: list[tuple[int, Array]]) -> Iterator[PcmRecord]:
        """`group`'s windows as records of up to RECORD_CHUNKS chunks (whole chunks but for
        the last one of a stream)."""
        most = RECORD_CHUNKS * self.plan.per_chunk
        for start in range(0, len(group), most):
            yield self._record(group[start : start + most])

    def _record(self, group: list[tuple[int, Array]]) -> PcmRecord:
        windows = np.stack([w for _, w in group])  # [n, channels, window]
        if self.plan.mono_rank1:
            windows = windows[:, 0]
        offset = group[0][0]
        return PcmRecord(
            {self.plan.input: windows},
            prepared=True,
            extra={"offset": offset},
            count=-(-len(group) // self.plan.per_chunk),
            plan=self.plan,
            fresh=offset == 0,
        )

    def _blocks(self) -> Iterator[bytes]:
        """Blocks of bytes as they come, until the end of the stream (or the stop flag)."""
        stop = self.ctx.stop_event
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        err_fd = -1
        if self.process is not None and self.process.stderr is not None:
            err_fd = self.process.stderr.fileno()
            poller.register(err_fd, select.POLLIN)
        while not stop.is_set():
            self.ctx.idle()
            events = poller.poll(POLL_MS)
            said = err_fd >= 0 and any(fd == err_fd for fd, _ in events)
            if said and not self._keep_stderr(err_fd):
                poller.unregister(err_fd)
                err_fd = -1
            if not any(fd == self.fd for fd, _ in events):
                continue
            try:
                data = os.read(self.fd, READ_BLOCK)
            except BlockingIOError:
                continue
            except OSError as e:
                raise SourceError(f"cannot read {self._what()}: {e.strerror or e}") from None
            if not data:
                return
            yield data

    def _keep_stderr(self, fd: int) -> bool:
        """What the command wrote to stderr, up to now (its last STDERR_KEPT bytes are kept);
        False at its end."""
        while True:
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            self._stderr += data
            del self._stderr[:-STDERR_KEPT]

    def _exited(self) -> str:
        """Why the command's stream ended, for the source_failed event."""
        assert self.process is not None
        try:
            code = self.process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return f"{self._what()} closed its output"
        if self.process.stderr is not None:
            self._keep_stderr(self.process.stderr.fileno())
        said = self._stderr.decode("utf-8", "replace").strip().splitlines()
        last = f": {said[-1][:200]}" if said else ""
        return f"{self._what()} exited with status {code}{last}"

    def _what(self) -> str:
        command = self.ctx.config.command
        return command[0] if command is not None else str(self.ctx.config.path)


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    """`signum` to the command's process group (made by `start_new_session`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
