"""The kinds of local source: synthetic, video (OpenCV), folder and pipe (CBOR sequence)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import select
import stat
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.inference.preprocess import load_cv2
from agent.models.backends.base import Array, TensorSpec
from agent.protocol import wire
from agent.sources.base import FIELD, FramingError, Outcome, ReaderContext, Record, SourceError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".ppm"})
ARRAY_SUFFIXES = frozenset({".npy", ".npz"})
DONE_DIR = "done"
FAILED_DIR = "failed"
IN_PROGRESS_SUFFIXES = (".tmp", ".partial")
READ_BLOCK = 1 << 20
VIDEO_TIMEOUT_MS = 10_000  # open/read timeout of network streams (OpenCV's FFmpeg backend)


def describe_where(config: SourceConfig) -> str:
    if config.device is not None:
        return f"camera {config.device}"
    return str(config.path if config.path is not None else config.url)


class SyntheticReader:
    """Generated inputs at `rate_hz`: the model's inputs (symbolic dims 1), or uint8 frames
    of `frame_shape` that go through the model's preprocessing like camera frames."""

    def __init__(self, ctx: ReaderContext, specs: Sequence[TensorSpec]) -> None:
        self.ctx = ctx
        config = ctx.config
        assert config.rate_hz is not None
        self.period = 1.0 / config.rate_hz
        self.random = config.fill == "random"
        self.rng = np.random.default_rng()
        if config.frame_shape is not None:
            self.shapes = {FIELD: (tuple(config.frame_shape), np.dtype(np.uint8))}
        else:
            self.shapes = {
                s.name: (tuple(d if isinstance(d, int) and d >= 0 else 1 for d in s.shape), s.dtype)
                for s in specs
            }
        self.fixed = {
            name: self._zeros(shape, dtype) for name, (shape, dtype) in self.shapes.items()
        }

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        array = np.zeros(shape, dtype=dtype)
        array.flags.writeable = False  # shared by every frame: nobody may change it
        return array

    def _generate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        if dtype.kind == "f":
            return self.rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
        if dtype.kind == "b":
            return self.rng.integers(0, 2, shape, dtype=np.uint8).astype(np.bool_)
        if dtype == np.uint8:
            return self.rng.integers(0, 256, shape, dtype=np.uint8)
        return self.rng.integers(0, 10, shape).astype(dtype)

    def records(self) -> Iterator[Record]:
        stop = self.ctx.stop_event
        prepared = self.ctx.config.frame_shape is None
        next_at = time.monotonic()
        while not stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0:
                if stop.wait(delay):
                    return
            elif delay < -2 * self.period:
                next_at = time.monotonic()  # fell behind (a stall): no burst to catch up
            next_at += self.period
            if self.random:
                fields = {n: self._generate(shape, dt) for n, (shape, dt) in self.shapes.items()}
            else:
                fields = dict(self.fixed)
            yield Record(fields, prepared=prepared)

    def close(self) -> None:
        pass


class VideoReader:
    """OpenCV `VideoCapture`: a file, an RTSP/HTTP URL, a V4L2 camera or a GStreamer pipeline.

    A live source is read continuously, even with `rate_hz` (frames in between are grabbed
    and discarded): a capture that is read slower than it delivers buffers old frames, and
    latency then grows without bound (the classic RTSP lag).
    """

    def __init__(self, ctx: ReaderContext) -> None:
        self.ctx = ctx
        found = load_cv2()
        config = ctx.config
        self.where = describe_where(config)
        if found is None:
            raise SourceError(
                'kind = "video" needs OpenCV: pip install opencv-python-headless (on a Jetson, '
                "the distribution's python3-opencv, which is built with GStreamer)"
            )
        self.cv2: ModuleType = found
        cv2 = found
        self.live = config.path is None
        target: str | int
        if config.device is not None:
            target = config.device
        else:
            target = str(config.path if config.path is not None else config.url)
        backend = config.backend or "auto"
        if backend != "auto":
            api = getattr(cv2, f"CAP_{backend.upper()}")
        elif config.device is not None and sys.platform.startswith("linux"):
            api = cv2.CAP_V4L2
        elif isinstance(target, str) and " ! " in target:  # a GStreamer pipeline (Jetson)
            api = cv2.CAP_GSTREAMER
        else:
            api = cv2.CAP_ANY
        if config.path is not None and not config.path.exists():
            raise SourceError(f"{self.where}: no such file")
        params: list[int] = []
        for name in ("CAP_PROP_OPEN_TIMEOUT_MSEC", "CAP_PROP_READ_TIMEOUT_MSEC"):
            if self.live and hasattr(cv2, name):
                params += [getattr(cv2, name), VIDEO_TIMEOUT_MS]
        self.capture = cv2.VideoCapture(target, api, params)
        if not self.capture.isOpened():
            self.capture.release()
            raise SourceError(f"cannot open {self.where} (OpenCV backend {config.backend})")

    def _read(self) -> Array | None:
        ok, frame = self.capture.read()
        return frame if ok and frame is not None else None

    def records(self) -> Iterator[Record]:
        config = self.ctx.config
        stop = self.ctx.stop_event
        period = 1.0 / config.rate_hz if config.rate_hz else None
        next_at = time.monotonic()
        while not stop.is_set():
            if period is not None and not self.live:
                delay = next_at - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    return
                next_at = max(next_at + period, time.monotonic() - period)
            if period is not None and self.live:
                if not self.capture.grab():
                    raise SourceError(f"{self.where}: no frame (stream lost)")
                if time.monotonic() < next_at:
                    continue  # discarded: keeps the capture's buffer fresh
                next_at = max(next_at + period, time.monotonic() - period)
                ok, frame = self.capture.retrieve()
                image = frame if ok else None
            else:
                image = self._read()
            if image is None:
                if self.live:
                    raise SourceError(f"{self.where}: no frame (stream lost)")
                if not config.loop:
                    return  # the end of the file
                self.capture.set(self.cv2.CAP_PROP_POS_FRAMES, 0)
                image = self._read()
                if image is None:
                    raise SourceError(f"{self.where}: cannot read a frame after rewinding")
            yield Record({FIELD: image}, bgr=True)

    def close(self) -> None:
        self.capture.release()


def _check_npy_header(f: Any, name: str, limits: wire.Limits) -> None:
    """The shape and dtype of an .npy stream, checked against the limits before it is read."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version in ((2, 0), (3, 0)):
        shape, _fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"{name}: unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError(f"{name}: object arrays are not accepted")
    if len(shape) > limits.max_rank:
        raise ValueError(f"{name}: rank {len(shape)} over the limit of {limits.max_rank}")
    elements = math.prod(int(d) for d in shape)
    if elements > limits.max_tensor_elements or elements * dtype.itemsize > limits.max_tensor_bytes:
        raise ValueError(f"{name}: {list(shape)} {dtype} is over the tensor size limits")


def load_array_file(path: Path, limits: wire.Limits) -> dict[str, Array]:
    """An .npy file as `{"frame": array}`, an .npz file as its named arrays; limits checked
    from the headers first, pickles refused."""
    if path.suffix.lower() == ".npy":
        with open(path, "rb") as f:
            _check_npy_header(f, path.name, limits)
        return {FIELD: np.load(path, allow_pickle=False)}
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        if len(members) > limits.max_tensors:
            raise ValueError(f"{path.name}: {len(members)} arrays, over {limits.max_tensors}")
        for member in members:
            with archive.open(member) as f:
                _check_npy_header(f, f"{path.name}:{member.filename}", limits)
    with np.load(path, allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


class FolderReader:
    """Files dropped into a folder, each processed once: moved to `done/` once its result is
    queued (to `failed/` when it cannot be used), so a restart picks up exactly the files
    whose results were never queued.

    Only complete files are taken: hidden names and `*.tmp`/`*.partial` are skipped (write
    elsewhere and rename into the folder), and a file must be unchanged for `settle_s`.
    """

    def __init__(self, ctx: ReaderContext, on_bad: Callable[[str], None]) -> None:
        self.ctx = ctx
        config = ctx.config
        assert config.path is not None
        self.folder = config.path
        self.on_bad = on_bad
        self.settle_s = 0.5 if config.settle_s is None else config.settle_s
        self.poll_interval_s = config.poll_interval_s or 0.5
        self.cv2 = load_cv2()
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        try:
            for sub in (DONE_DIR, FAILED_DIR):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SourceError(f"cannot use folder {self.folder}: {e.strerror or e}") from None

    def _warn_once(self, message: str) -> None:
        if message not in self._warned and len(self._warned) < 1024:
            self._warned.add(message)
            log.warning("source %s: %s", self.ctx.config.name, message)

    def _candidates(self) -> list[Path]:
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError as e:
            raise SourceError(f"cannot list {self.folder}: {e.strerror or e}") from None
        now = time.time()
        found = []
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name.endswith(IN_PROGRESS_SUFFIXES):
                continue
            try:
                if not entry.is_file():
                    continue
                mtime = entry.stat().st_mtime
            except OSError:
                continue  # gone meanwhile
            suffix = Path(name).suffix.lower()
            if suffix not in ARRAY_SUFFIXES and suffix not in IMAGE_SUFFIXES:
                self._warn_once(f"{name}: ignored (takes .npy, .npz and images)")
                continue
            if suffix in IMAGE_SUFFIXES and self.cv2 is None:
                self._warn_once(f"{name}: left in place, images need OpenCV")
                continue
            with self._lock:
                if name in self._in_flight:
                    continue
            if now - mtime < self.settle_s:
                continue  # still being written, perhaps
            found.append(Path(entry.path))
        return found

    def _load(self, path: Path) -> Record:
        name = path.name
        if path.suffix.lower() in ARRAY_SUFFIXES:
            fields = load_array_file(path, self.ctx.limits)
            return Record(fields, file=name)
        assert self.cv2 is not None
        size = path.stat().st_size
        if size > self.ctx.limits.max_payload_bytes:
            raise ValueError(f"{name}: {size} bytes, over max_payload_bytes")
        image = self.cv2.imread(str(path), self.cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError(f"{name}: not an image OpenCV can read")
        if image.nbytes > self.ctx.limits.max_tensor_bytes:
            raise ValueError(f"{name}: decodes to {image.nbytes} bytes, over max_tensor_bytes")
        return Record({FIELD: image}, bgr=True, file=name)

    def _move(self, name: str, sub: str) -> None:
        source = self.folder / name
        target = self.folder / sub / name
        n = 0
        while target.exists():  # the same name dropped again: keep both
            n += 1
            target = self.folder / sub / f"{Path(name).stem}.{n}{Path(name).suffix}"
        try:
            os.replace(source, target)
        except OSError as e:
            log.error("source %s: cannot move %s to %s/: %s", self.ctx.config.name, name, sub, e)

    def _finisher(self, name: str) -> Callable[[Outcome], None]:
        def finish(outcome: Outcome) -> None:
            if outcome == "done":
                self._move(name, DONE_DIR)
            elif outcome == "failed":
                self._move(name, FAILED_DIR)
            # retry / dropped: the file stays and is taken again by a later scan or run
            with self._lock:
                self._in_flight.discard(name)

        return finish

    def records(self) -> Iterator[Record]:
        stop = self.ctx.stop_event
        while not stop.is_set():
            for path in self._candidates():
                if stop.is_set():
                    return
                try:
                    record = self._load(path)
                except FileNotFoundError:
                    continue  # taken away meanwhile
                except (OSError, ValueError, zipfile.BadZipFile) as e:
                    message = str(e) if path.name in str(e) else f"{path.name}: {e}"
                    self.on_bad(message)
                    self._move(path.name, FAILED_DIR)
                    continue
                with self._lock:
                    self._in_flight.add(path.name)
                record.on_done = self._finisher(path.name)
                yield record
            self.ctx.idle()
            if stop.wait(self.poll_interval_s):
                return

    def close(self) -> None:
        pass


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
    limits (agent.protocol.wire), so a broken writer costs errors, never memory.
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
            payload = wire.decode_payload(data, self.limits)
            if len(payload) > self.limits.max_tensors:
                raise wire.WireError("bad_request", f"over {self.limits.max_tensors} tensors")
            fields = {k: wire.decode_tensor(v, self.limits, name=k) for k, v in payload.items()}
        except wire.WireError as e:
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
