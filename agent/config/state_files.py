"""Files under `state_dir`: folders 0700, files 0600, whatever the process's umask.

The state folder holds the spool (requests and replies, which may carry what a backend would
not show anyone else on the box), the connection epoch and the sources' `seq` files. Every
part of the agent that writes there creates its folders and files through these helpers;
an existing folder or file that is more open than that is tightened, and where that fails
(another owner, a read-only mount) a WARNING says so and the agent carries on.

Also the one way a small state file is replaced: written aside, fsynced, renamed over the old
one, and the folder fsynced, so a power cut leaves the old or the new file, never a torn one.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """`path` and its missing parents created 0700; `path` itself tightened to 0700 if it
    exists with group or world bits (a WARNING where it cannot be changed)."""
    missing: list[Path] = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another thread
        _chmod(folder, DIR_MODE)  # mkdir's mode passes through the umask
    if not missing:
        tighten(path, DIR_MODE)
    return path


def tighten(path: Path, mode: int) -> bool:
    """Remove the bits of `path` beyond `mode`; False (and a WARNING) where they stay."""
    try:
        current = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return True
    if not current & ~mode:
        return True
    try:
        os.chmod(path, current & mode)
    except OSError as e:
        log.warning(
            "state: %s is mode %o (group/world may read it) and cannot be changed to %o: %s",
            path,
            current,
            mode,
            e.strerror or e,
        )
        return False
    log.info("state: tightened %s from mode %o to %o", path, current, current & mode)
    return True


def private_file(path: Path) -> None:
    """Create `path` empty with mode 0600 if it is missing; tighten it if it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        tighten(path, FILE_MODE)
        return
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` (mode 0600): temp file, fsync, rename, fsync of the folder."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (where the file system allows opening a folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder: the rename is as durable as it gets
    finally:
        os.close(fd)


def _chmod(path: Path, mode: int) -> None:
    try:
        os.chmod(path, mode)
    except OSError as e:
        log.warning("state: cannot set mode %o on %s: %s", mode, path, e.strerror or e)
