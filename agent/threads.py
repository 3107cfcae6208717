"""Threads whose names the kernel knows too.

Python's thread names stay inside the interpreter: `top -H`, `ps -L`, `pidstat -t`, py-spy's
native frames and `/proc/PID/task/TID/comm` all show every thread of the agent as `python`.
An operator looking at which thread of the daemon burns a core, or a benchmark reading each
thread's CPU from `/proc`, needs the name there: `NamedThread` gives it to the kernel
(Linux `prctl(PR_SET_NAME)`, the first 15 bytes) as the thread starts. Python 3.14 does the
same by itself; the agent runs on 3.10 (JetPack 6).

A leaf: the standard library only, so that every package may use it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

_PR_SET_NAME = 15
_NAME_BYTES = 15  # the kernel keeps 16 with the terminating zero


def _find_prctl() -> Any:
    """libc's `prctl`, or None off Linux (or where it cannot be found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def name_this_thread(name: str) -> None:
    """Give the calling thread's name to the kernel (its first 15 bytes); nothing where the
    platform has no `prctl`. A failure is ignored: a name is never worth an error."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_NAME, name.encode("utf-8", "replace")[:_NAME_BYTES], 0, 0, 0)


def name_thread(thread: threading.Thread, name: str, kernel_name: str | None = None) -> None:
    """Name a running thread that is not a `NamedThread` (a library's), in Python and, on
    Linux, in the kernel (`kernel_name`, where the first 15 bytes of `name` would not tell it
    from another): a thread may rename another of its process through
    `/proc/self/task/TID/comm`. Nothing more where that fails: a name is never worth an
    error."""
    thread.name = name
    tid = thread.native_id
    if tid is None or not sys.platform.startswith("linux"):
        return
    short = (kernel_name or name).encode("utf-8", "replace")[:_NAME_BYTES]
    try:
        with open(f"/proc/self/task/{tid}/comm", "wb") as comm:
            comm.write(short)
    except OSError:
        pass  # the thread ended meanwhile, or /proc is not mounted


class NamedThread(threading.Thread):
    """A `threading.Thread` that names itself in the kernel when it starts."""

    def run(self) -> None:
        name_this_thread(self.name)
        super().run()
