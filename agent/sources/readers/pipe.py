"""The pipe source: a CBOR sequence (RFC 8742) of tensor maps on a FIFO, a file or stdin, and
the framing that finds where each record ends before it is decoded."""

from __future__ import annotations

import dataclasses
import os
import select
import stat
import sys
from collections.abc import Callable, Iterator

from agent.protocol.errors import WireError
from agent.protocol.payload import decode_payload
from agent.protocol.tensors import decode_tensor
from agent.sources.base import FramingError, ReaderContext, Record, SourceError

READ_BLOCK = 1 << 20


def cbor_item_end(
    buf: bytes | bytearray | memoryview, start: int, *, max_items: int, max_depth: int
) -> int | None:
    """The offset just after the CBOR item at `start`, or None while it is incomplete.

    Reads item headers only (string bodies are skipped), so finding the end of a record in a
    CBOR sequence (RFC 8742) costs the number of its items, which `max_items` bounds.
    """
    n = len(buf)
    pos = start
    stack: list[int] = []  # items left in each open container; -1: indefinite length
    items = 0
    while True:
        if pos >= n:
            return None
        initial = buf[pos]
        pos += 1
        major, info = initial >> 5, initial & 0x1F
        if initial == 0xFF:
            if not stack or stack[-1] != -1:
                raise FramingError("a break code outside an indefinite-length item")
            stack.pop()
        else:
            items += 1
            if items > max_items:
                raise FramingError(f"a record holds more than {max_items} CBOR items")
            if info < 24:
                arg = info
            elif info < 28:
                size = 1 << (info - 24)
                if pos + size > n:
                    return None
                arg = int.from_bytes(buf[pos : pos + size], "big")
                pos += size
            elif info == 31 and 2 <= major <= 5:
                arg = -1
            else:
                raise FramingError(f"malformed CBOR (additional information {info})")
            if major in (2, 3):
                if arg == -1:
                    stack.append(-1)
                    continue
                pos += arg
                if pos > n:
                    return None
            elif major in (4, 5):
                count = -1 if arg == -1 else arg * (2 if major == 5 else 1)
                if count:
                    if len(stack) >= max_depth:
                        raise FramingError(f"CBOR nesting deeper than {max_depth} levels")
                    stack.append(count)
                    continue
            elif major == 6:
                if len(stack) >= max_depth:
                    raise FramingError(f"CBOR nesting deeper than {max_depth} levels")
                stack.append(1)
                continue
        # One item is complete: count it in the containers it completes.
        while stack:
            if stack[-1] == -1:
                break
            stack[-1] -= 1
            if stack[-1]:
                break
            stack.pop()
        else:
            return pos


class PipeReader:
    """A CBOR sequence (RFC 8742) of maps `{name: tensor}` on a FIFO, a file or stdin.

    A FIFO outlives its writers: when one closes, the reader opens it again and waits for the
    next (a half-written record is discarded). Every record is decoded with the agent's
    limits (agent.protocol), so a broken writer costs errors, never memory.
    """

    def __init__(self, ctx: ReaderContext, on_bad: Callable[[str], None]) -> None:
        self.ctx = ctx
        self.on_bad = on_bad
        config = ctx.config
        assert config.path is not None
        self.path = config.path
        self.stdin = str(self.path) == "-"
        self.max_record = config.max_record_bytes or ctx.limits.max_payload_bytes
        limits = ctx.limits
        if self.max_record > limits.max_payload_bytes:
            limits = dataclasses.replace(limits, max_payload_bytes=self.max_record)
        self.limits = limits
        self.fifo = False
        self.fd = -1
        self._open()

    def _open(self) -> None:
        if self.stdin:
            self.fd = os.dup(sys.stdin.fileno())
            os.set_blocking(self.fd, False)
            return
        try:
            if not self.path.exists():
                os.mkfifo(self.path, 0o660)
            self.fifo = stat.S_ISFIFO(self.path.stat().st_mode)
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise SourceError(f"cannot open {self.path}: {e.strerror or e}") from None

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _decode(self, data: bytes) -> Record:
        try:
            payload = decode_payload(data, self.limits)
            if len(payload) > self.limits.max_tensors:
                raise WireError("bad_request", f"over {self.limits.max_tensors} tensors")
            fields = {k: decode_tensor(v, self.limits, name=k) for k, v in payload.items()}
        except WireError as e:
            return Record({}, error=f"bad record: {e.message}")
        return Record(fields)

    def records(self) -> Iterator[Record]:
        stop = self.ctx.stop_event
        buf = bytearray()
        start = 0
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not stop.is_set():
            self.ctx.idle()
            if not poller.poll(200):
                continue
            try:
                data = os.read(self.fd, READ_BLOCK)
            except BlockingIOError:
                continue
            except OSError as e:
                raise SourceError(f"cannot read {self.path}: {e.strerror or e}") from None
            if not data:  # every writer closed
                if len(buf) > start:
                    self.on_bad(f"{len(buf) - start} bytes of a record cut off at the end")
                if not self.fifo:
                    return
                poller.unregister(self.fd)
                self._close_fd()
                self._open()  # wait for the next writer
                poller.register(self.fd, select.POLLIN)
                buf.clear()
                start = 0
                continue
            buf += data
            while True:
                try:
                    end = cbor_item_end(
                        buf, start, max_items=self.limits.max_items, max_depth=self.limits.max_depth
                    )
                except FramingError as e:
                    raise SourceError(f"{self.path}: not a CBOR sequence of maps: {e}") from None
                if end is None:
                    if len(buf) - start > self.max_record:
                        raise SourceError(
                            f"{self.path}: a record over {self.max_record} bytes (max_record_bytes)"
                        )
                    break
                if end - start > self.max_record:
                    raise SourceError(
                        f"{self.path}: a record over {self.max_record} bytes (max_record_bytes)"
                    )
                record = self._decode(bytes(buf[start:end]))
                start = end
                yield record
            if start:
                del buf[:start]  # once per read, not per record
                start = 0

    def close(self) -> None:
        self._close_fd()
