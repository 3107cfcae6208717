"""The folder source: files dropped into a folder, each run once and then moved aside; and
the checked loading of .npy/.npz files."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import Array
from agent.models.preprocess import load_cv2
from agent.protocol.errors import Limits
from agent.sources.base import FIELD, Outcome, ReaderContext, Record, SourceError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".ppm"})
ARRAY_SUFFIXES = frozenset({".npy", ".npz"})
DONE_DIR = "done"
FAILED_DIR = "failed"
IN_PROGRESS_SUFFIXES = (".tmp", ".partial")


def _check_npy_header(f: Any, name: str, limits: Limits) -> None:
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


def load_array_file(path: Path, limits: Limits) -> dict[str, Array]:
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
