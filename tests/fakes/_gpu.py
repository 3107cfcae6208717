"""The fake GPU behind the fake ``pycuda`` and ``tensorrt`` modules.

One :class:`FakeGPU` per test (installed by :func:`tests.fakes.install`). It keeps what a
test wants to assert on and a real GPU hides:

* device memory: every allocation with its owner (pycuda, or TensorRT's own engine and
  activation memory), bytes in use, peak, a leak check;
* the CUDA context stack of each thread (pycuda's rule: a CUDA call needs a current
  context in *this* thread);
* streams with a queue of pending work that runs, in order, only at ``synchronize()``:
  reading a result before synchronizing reads stale data, as on a real GPU;
* an event log (allocations, frees, TensorRT objects destroyed and whether a CUDA context
  was current at that moment), to check teardown order.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# CUDA result strings as cuGetErrorString spells them.
INVALID_CONTEXT = "invalid device context"
INVALID_VALUE = "invalid argument"
INVALID_HANDLE = "invalid resource handle"
OUT_OF_MEMORY = "out of memory"
NOT_INITIALIZED = "initialization error"
ILLEGAL_ADDRESS = "an illegal memory access was encountered"


class Error(Exception):
    """pycuda.driver.Error"""


class LogicError(Error):
    """pycuda.driver.LogicError: most CUDA error codes (invalid context, bad argument)."""


class MemoryError(Error):
    """pycuda.driver.MemoryError: CUDA_ERROR_OUT_OF_MEMORY."""


class LaunchError(Error):
    """pycuda.driver.LaunchError"""


class RuntimeError(Error):
    """pycuda.driver.RuntimeError"""


def cuda_error(routine: str, code: str, message: str | None = None) -> Error:
    """pycuda's message format: ``ROUTINE failed: ERROR STRING[ - detail]``."""
    text = f"{routine} failed: {code}" + (f" - {message}" if message else "")
    if code == OUT_OF_MEMORY:
        return MemoryError(text)
    return LogicError(text)


@dataclass
class Region:
    """One allocation in the fake address space."""

    address: int
    nbytes: int
    kind: str  # "device", "pinned", "mapped", "trt-engine", "trt-context"
    label: str
    data: np.ndarray[Any, np.dtype[np.uint8]]
    live: bool = True


@dataclass
class Event:
    name: str
    thread: str
    cuda_current: bool
    details: dict[str, Any] = field(default_factory=dict)


class FakeStream:
    """A CUDA stream: work is queued and runs in order at synchronize()."""

    def __init__(self, gpu: FakeGPU, handle: int) -> None:
        self.gpu = gpu
        self.handle = handle
        self.pending: list[Callable[[], None]] = []
        self.lock = threading.Lock()

    def enqueue(self, work: Callable[[], None]) -> None:
        with self.lock:
            self.pending.append(work)

    def run_pending(self) -> None:
        while True:
            with self.lock:
                if not self.pending:
                    return
                work = self.pending.pop(0)
            work()


class FakeGPU:
    """The state of one fake device (ordinal 0)."""

    def __init__(
        self,
        *,
        name: str = "Orin (fake)",
        compute_capability: tuple[int, int] = (8, 7),
        total_memory: int = 8 * 1024**3,
        integrated: bool = True,
        trt_version: str = "10.3.0",
    ) -> None:
        self.name = name
        self.compute_capability = compute_capability
        self.total_memory = total_memory
        self.integrated = integrated
        self.trt_version = trt_version
        self.initialized = False
        self._lock = threading.RLock()
        self._regions: dict[int, Region] = {}
        self._next_address = 0x7F00_0000_0000
        self._next_handle = itertools.count(0x5000)
        self.streams: dict[int, FakeStream] = {}
        self._stacks: dict[int, list[Any]] = {}  # thread ident -> context stack
        self._threads: dict[int, threading.Thread] = {}
        self.events: list[Event] = []
        self.peak_device_bytes = 0
        self.primary_retains = 0
        self.stream_count = 0
        self.trt_logger: Any = None  # the global logger TensorRT keeps (first one given)
        self.timing_cache_hits = 0
        self.timing_cache_misses = 0
        self.builds = 0
        # Tests only: called as hook(phase, step) before each step of a build completes (with
        # or without a progress monitor), e.g. to hold a build while its progress is read.
        self.build_hook: Callable[[str, int], None] | None = None

    # -- version -------------------------------------------------------------------------

    @property
    def trt(self) -> tuple[int, int]:
        major, minor, *_ = (int(p) for p in self.trt_version.split("."))
        return major, minor

    # -- contexts --------------------------------------------------------------------------

    def stack(self) -> list[Any]:
        ident = threading.get_ident()
        with self._lock:
            self._threads[ident] = threading.current_thread()
            return self._stacks.setdefault(ident, [])

    def current_context(self) -> Any:
        stack = self.stack()
        return stack[-1] if stack else None

    def require_context(self, routine: str) -> Any:
        """What pycuda does before a driver call: no current context -> LogicError."""
        if not self.initialized:
            raise cuda_error(routine, NOT_INITIALIZED)
        context = self.current_context()
        if context is None:
            raise cuda_error(
                "explicit_context_dependent", INVALID_CONTEXT, "no currently active context?"
            )
        return context

    def leftover_contexts(self) -> dict[str, int]:
        """Threads (alive or not) that still have a context pushed."""
        with self._lock:
            return {
                self._threads[i].name: len(s)
                for i, s in self._stacks.items()
                if s and i in self._threads
            }

    # -- memory ----------------------------------------------------------------------------

    def allocate(
        self, nbytes: int, kind: str, label: str, data: np.ndarray[Any, Any] | None = None
    ) -> Region:
        if nbytes <= 0:
            raise cuda_error("cuMemAlloc", INVALID_VALUE)
        with self._lock:
            if (
                kind in ("device", "trt-engine", "trt-context")
                and self.device_bytes + nbytes > self.total_memory
            ):
                raise cuda_error("cuMemAlloc", OUT_OF_MEMORY)
            # 256-byte aligned (as cuMemAlloc), with a gap so an overrun never lands in
            # the next allocation but faults
            address = self._next_address
            self._next_address += -(-nbytes // 4096) * 4096 + 4096
            buffer = data if data is not None else np.zeros(nbytes, dtype=np.uint8)
            region = Region(address, nbytes, kind, label, buffer)
            self._regions[address] = region
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.record("alloc", kind=kind, label=label, nbytes=nbytes, address=address)
        return region

    def release(self, address: int) -> None:
        with self._lock:
            region = self._regions.get(address)
            if region is None or not region.live:
                raise cuda_error("cuMemFree", INVALID_VALUE)
            region.live = False
            del self._regions[address]
        self.record(
            "free", kind=region.kind, label=region.label, nbytes=region.nbytes, address=address
        )

    def view(self, pointer: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes at ``pointer``; an address outside every live region is a fault."""
        with self._lock:
            for region in self._regions.values():
                if region.address <= pointer and pointer + nbytes <= region.address + region.nbytes:
                    offset = pointer - region.address
                    return region.data[offset : offset + nbytes]
        raise cuda_error("cuMemcpy", ILLEGAL_ADDRESS, f"{nbytes} bytes at {pointer:#x}")

    def _bytes(self, kinds: tuple[str, ...]) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._regions.values() if r.kind in kinds)

    @property
    def device_bytes(self) -> int:
        """Device memory in use: pycuda allocations plus TensorRT's own."""
        return self._bytes(("device", "trt-engine", "trt-context"))

    @property
    def pinned_bytes(self) -> int:
        return self._bytes(("pinned", "mapped"))

    def live(self, kind: str | None = None) -> list[Region]:
        with self._lock:
            return [r for r in self._regions.values() if kind is None or r.kind == kind]

    # -- streams ---------------------------------------------------------------------------

    def new_stream(self) -> FakeStream:
        with self._lock:
            handle = next(self._next_handle)
            stream = FakeStream(self, handle)
            self.streams[handle] = stream
            self.stream_count += 1
        return stream

    def drop_stream(self, handle: int) -> None:
        with self._lock:
            self.streams.pop(handle, None)
            self.stream_count -= 1

    def stream(self, handle: int) -> FakeStream | None:
        with self._lock:
            return self.streams.get(handle)

    # -- events ----------------------------------------------------------------------------

    def record(self, name: str, **details: Any) -> None:
        event = Event(
            name, threading.current_thread().name, self.current_context() is not None, details
        )
        with self._lock:
            self.events.append(event)

    def names(self, *wanted: str) -> list[str]:
        """Event names, only those in ``wanted`` if given, in order."""
        with self._lock:
            return [e.name for e in self.events if not wanted or e.name in wanted]


_current: FakeGPU | None = None


def current() -> FakeGPU:
    """The installed fake GPU; the fakes are only usable inside the fixture."""
    if _current is None:
        raise Error("fake GPU not installed: use the fake_gpu fixture (tests/fakes)")
    return _current


def set_current(gpu: FakeGPU | None) -> None:
    global _current
    _current = gpu
