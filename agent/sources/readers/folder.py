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


Stamp = tuple[int, int, int]  # a file's inode, size and mtime (ns): the file read, not its name
MOVE_FAILURES = 3  # moves in a row that fail before the source fails (`source_failed`, backoff)


class _FolderState:
    """What a folder's readers share (a source reopened makes a new reader while its frames
    still wait in the runner's queue): the files taken, and the files run (or found bad) that
    could not be moved aside, with the folder they are to go to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: dict[str, Stamp] = {}
        self.unmoved: dict[str, tuple[Stamp, str]] = {}
        self.failures = 0
        self.last_failure = ""


_STATES: dict[Path, _FolderState] = {}
_STATES_LOCK = threading.Lock()


def _state_of(folder: Path) -> _FolderState:
    with _STATES_LOCK:
        return _STATES.setdefault(folder.resolve(), _FolderState())


def _stamp(path: Path) -> Stamp | None:
    try:
        return _stamp_of(path.stat())
    except OSError:
        return None


def _stamp_of(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class FolderReader:
    """Files dropped into a folder, each processed once: moved to `done/` once its result is
    queued (to `failed/` when it cannot be used), so a restart picks up exactly the files
    whose results were never queued.

    Only complete files are taken: hidden names and `*.tmp`/`*.partial` are skipped (write
    elsewhere and rename into the folder), and a file must be unchanged for `settle_s`. A
    file is known by its inode, size and mtime: one replaced under its name while the first
    waited is run too, not moved aside unread. A file that cannot be moved aside (a full or
    read-only disk) is not run again: the move is tried again at each scan, and moves that
    keep failing fail the source (`source_failed`, its backoff).
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
        self._warned: set[str] = set()
        try:
            for sub in (DONE_DIR, FAILED_DIR):
                (self.folder / sub).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SourceError(f"cannot use folder {self.folder}: {e.strerror or e}") from None
        self._state = _state_of(self.folder)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned and len(self._warned) < 1024:
            self._warned.add(message)
            log.warning("source %s: %s", self.ctx.config.name, message)

    def _candidates(self) -> list[tuple[Path, Stamp]]:
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError as e:
            raise SourceError(f"cannot list {self.folder}: {e.strerror or e}") from None
        now = time.time()
        found = []
        state = self._state
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name.endswith(IN_PROGRESS_SUFFIXES):
                continue
            try:
                if not entry.is_file():
                    continue
                st = entry.stat()
            except OSError:
                continue  # gone meanwhile
            suffix = Path(name).suffix.lower()
            if suffix not in ARRAY_SUFFIXES and suffix not in IMAGE_SUFFIXES:
                self._warn_once(f"{name}: ignored (takes .npy, .npz and images)")
                continue
            if suffix in IMAGE_SUFFIXES and self.cv2 is None:
                self._warn_once(f"{name}: left in place, images need OpenCV")
                continue
            stamp = _stamp_of(st)
            with state.lock:
                if name in state.in_flight:
                    continue  # taken (a replacement waits for it to finish)
                unmoved = state.unmoved.get(name)
            if unmoved is not None and unmoved[0] == stamp:
                continue  # run already; only its move is left
            if now - st.st_mtime < self.settle_s:
                continue  # still being written, perhaps
            found.append((Path(entry.path), stamp))
        return found

    def _load(self, path: Path) -> Record:
        # the `file` a message shows: text (a name that is not UTF-8 shown with U+FFFD)
        name = path.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
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

    def _move(self, name: str, sub: str, stamp: Stamp) -> None:
        """The file read (`stamp`) moved into `sub`; one replaced meanwhile stays, to be run.
        A move that fails leaves it `unmoved`: tried again at each scan, never run again."""
        source = self.folder / name
        if _stamp(source) != stamp:
            return  # gone, or replaced under its name: the new one is run by a later scan
        target = self.folder / sub / name
        n = 0
        while target.exists():  # the same name dropped again: keep both
            n += 1
            target = self.folder / sub / f"{Path(name).stem}.{n}{Path(name).suffix}"
        state = self._state
        try:
            os.replace(source, target)
        except OSError as e:
            with state.lock:
                first = name not in state.unmoved
                state.unmoved[name] = (stamp, sub)
                state.failures += 1
                state.last_failure = f"cannot move {name} to {sub}/: {e.strerror or e}"
            if first:
                log.error("source %s: %s", self.ctx.config.name, state.last_failure)
            return
        with state.lock:
            state.unmoved.pop(name, None)
            state.failures = 0

    def _move_unmoved(self) -> None:
        """Each file run (or found bad) but not moved aside: its move tried again. Moves that
        keep failing fail the source: the runner reports it and backs off."""
        state = self._state
        with state.lock:
            waiting = list(state.unmoved.items())
        for name, (stamp, sub) in waiting:
            if _stamp(self.folder / name) != stamp:
                with state.lock:
                    state.unmoved.pop(name, None)  # gone, or replaced: nothing to move
                continue
            self._move(name, sub, stamp)
        with state.lock:
            failing, why = state.failures >= MOVE_FAILURES, state.last_failure
            if failing:
                state.failures = 0
        if failing:
            raise SourceError(why)

    def _finisher(self, name: str, stamp: Stamp) -> Callable[[Outcome], None]:
        def finish(outcome: Outcome) -> None:
            if outcome == "done":
                self._move(name, DONE_DIR, stamp)
            elif outcome == "failed":
                self._move(name, FAILED_DIR, stamp)
            # retry / dropped: the file stays and is taken again by a later scan or run
            with self._state.lock:
                if self._state.in_flight.get(name) == stamp:
                    del self._state.in_flight[name]

        return finish

    def records(self) -> Iterator[Record]:
        stop = self.ctx.stop_event
        while not stop.is_set():
            self._move_unmoved()
            for path, stamp in self._candidates():
                if stop.is_set():
                    return
                try:
                    record = self._load(path)
                except FileNotFoundError:
                    continue  # taken away meanwhile
                except (OSError, ValueError, zipfile.BadZipFile) as e:
                    message = str(e) if path.name in str(e) else f"{path.name}: {e}"
                    self.on_bad(message)
                    self._move(path.name, FAILED_DIR, stamp)
                    continue
                with self._state.lock:
                    self._state.in_flight[path.name] = stamp
                record.on_done = self._finisher(path.name, stamp)
                yield record
            self.ctx.idle()
            if stop.wait(self.poll_interval_s):
                return

    def close(self) -> None:
        pass
