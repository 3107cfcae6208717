"""A test double of ``pycuda.driver``, faithful where the agent's correctness depends on it.

Mirrored from pycuda (src/cpp/cuda.hpp, src/wrapper/wrap_cudadrv.cpp):

* ``init()`` first, else ``cuDeviceGet failed: initialization error``;
* ``Device.retain_primary_context()`` does *not* make the context current; ``push()`` does,
  per thread; ``Context.pop()`` is a static method and fails on an empty stack;
* every allocation, stream and copy needs a current context in the calling thread:
  ``explicit_context_dependent failed: invalid device context - no currently active
  context?`` (``LogicError``);
* ``free()`` (or release by the garbage collector) from a thread where the owning context
  is not current and which did not create it: pycuda only warns
  ``... in out-of-thread context could not be cleaned up`` and the memory stays allocated —
  the leak a test must be able to see;
* freeing twice: ``device_allocation::free failed: invalid resource handle``;
* asynchronous copies from/to page-locked memory run at ``synchronize()``; copies from
  pageable memory are synchronous (CUDA stages them).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

from tests.fakes import _gpu
from tests.fakes._gpu import Error, LaunchError, LogicError, MemoryError, RuntimeError

__all__ = [
    "Context",
    "Device",
    "DeviceAllocation",
    "Error",
    "HostAllocation",
    "LaunchError",
    "LogicError",
    "MemoryError",
    "PagelockedHostAllocation",
    "RuntimeError",
    "Stream",
    "ctx_flags",
    "device_attribute",
    "get_version",
    "host_alloc_flags",
    "init",
    "mem_alloc",
    "mem_get_info",
    "memcpy_dtoh",
    "memcpy_dtoh_async",
    "memcpy_htod",
    "memcpy_htod_async",
    "pagelocked_empty",
]


def get_version() -> tuple[int, int, int]:
    return (12, 6, 0)


def init(flags: int = 0) -> None:
    _gpu.current().initialized = True


class ctx_flags:
    SCHED_AUTO = 0
    SCHED_SPIN = 1
    SCHED_YIELD = 2
    SCHED_BLOCKING_SYNC = 4
    MAP_HOST = 8
    LMEM_RESIZE_TO_MAX = 16


class host_alloc_flags:
    PORTABLE = 1
    DEVICEMAP = 2
    WRITECOMBINED = 4


class device_attribute:
    MAX_THREADS_PER_BLOCK = 1
    MULTIPROCESSOR_COUNT = 16
    INTEGRATED = 18
    CAN_MAP_HOST_MEMORY = 19
    UNIFIED_ADDRESSING = 41
    COMPUTE_CAPABILITY_MAJOR = 75
    COMPUTE_CAPABILITY_MINOR = 76


def _cleanup(ward: Context, what: str, action: Any) -> bool:
    """pycuda's ``scoped_context_activation`` around a release: True if it ran.

    The ward context current: run. Not current but this is the thread that created the
    context: push, run, pop. Otherwise: warn and leak (CUDAPP_CATCH_CLEANUP_ON_DEAD_CONTEXT).
    """
    gpu = ward.gpu
    if not ward.valid:
        return False  # dead context: pycuda silently skips
    if gpu.current_context() is ward:
        action()
        return True
    if threading.get_ident() == ward.thread:
        gpu.stack().append(ward)
        try:
            action()
        finally:
            gpu.stack().pop()
        return True
    warnings.warn(
        f"{what} in out-of-thread context could not be cleaned up", UserWarning, stacklevel=3
    )
    gpu.record("leak", what=what)
    return False


class Device:
    def __init__(self, number: int) -> None:
        gpu = _gpu.current()
        if not gpu.initialized:
            raise _gpu.cuda_error("cuDeviceGet", _gpu.NOT_INITIALIZED)
        if number != 0:
            raise _gpu.cuda_error("cuDeviceGet", "invalid device ordinal")
        self.gpu = gpu
        self.number = number

    @staticmethod
    def count() -> int:
        if not _gpu.current().initialized:
            raise _gpu.cuda_error("cuDeviceGetCount", _gpu.NOT_INITIALIZED)
        return 1

    def name(self) -> str:
        return self.gpu.name

    def compute_capability(self) -> tuple[int, int]:
        return self.gpu.compute_capability

    def total_memory(self) -> int:
        return self.gpu.total_memory

    def get_attribute(self, attribute: int) -> int:
        values = {
            device_attribute.INTEGRATED: int(self.gpu.integrated),
            device_attribute.CAN_MAP_HOST_MEMORY: 1,
            device_attribute.UNIFIED_ADDRESSING: 1,
            device_attribute.MULTIPROCESSOR_COUNT: 16,
            device_attribute.COMPUTE_CAPABILITY_MAJOR: self.gpu.compute_capability[0],
            device_attribute.COMPUTE_CAPABILITY_MINOR: self.gpu.compute_capability[1],
        }
        return values.get(attribute, 0)

    def retain_primary_context(self) -> Context:
        """cuDevicePrimaryCtxRetain: returns the context, does not push it."""
        self.gpu.primary_retains += 1
        return Context(self.gpu, primary=True)

    def make_context(self, flags: int = 0) -> Context:
        """cuCtxCreate: a new context, pushed on this thread's stack."""
        context = Context(self.gpu, primary=False)
        self.gpu.stack().append(context)
        return context

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.number == self.number

    def __hash__(self) -> int:
        return hash(self.number)


class Context:
    def __init__(self, gpu: _gpu.FakeGPU, *, primary: bool) -> None:
        self.gpu = gpu
        self.primary = primary
        self.thread = threading.get_ident()  # pycuda's m_thread
        self.valid = True

    def push(self) -> None:
        if not self.valid:
            raise _gpu.cuda_error("cuCtxPushCurrent", _gpu.INVALID_CONTEXT)
        self.gpu.stack().append(self)

    @staticmethod
    def pop() -> None:
        stack = _gpu.current().stack()
        if not stack:
            raise _gpu.cuda_error(
                "context::pop", _gpu.INVALID_CONTEXT, "cannot pop non-current context"
            )
        stack.pop()

    @staticmethod
    def get_current() -> Context | None:
        context: Context | None = _gpu.current().current_context()
        return context

    @staticmethod
    def get_device() -> Device:
        _gpu.current().require_context("cuCtxGetDevice")
        return Device(0)

    @staticmethod
    def synchronize() -> None:
        gpu = _gpu.current()
        gpu.require_context("cuCtxSynchronize")
        for stream in list(gpu.streams.values()):
            stream.run_pending()

    def detach(self) -> None:
        """Release: for a primary context, cuDevicePrimaryCtxRelease. Out of thread and not
        current: pycuda silently skips the release (the context "has already been deleted")."""
        if not self.valid:
            raise _gpu.cuda_error(
                "context::detach", _gpu.INVALID_CONTEXT, "cannot detach from invalid context"
            )
        current = self.gpu.current_context() is self
        if current or threading.get_ident() == self.thread:
            if self.primary:
                self.gpu.primary_retains -= 1
            self.gpu.record("context_released", primary=self.primary)
        else:
            self.gpu.record("leak", what="context")
        self.valid = False
        stack = self.gpu.stack()
        if current:
            stack.pop()

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)


class DeviceAllocation:
    """What ``mem_alloc`` returns: ``int()`` is the device pointer."""

    def __init__(self, region: _gpu.Region, ward: Context) -> None:
        self._region = region
        self._ward = ward
        self._valid = True

    def __int__(self) -> int:
        return self._region.address

    __index__ = __int__

    def free(self) -> None:
        if not self._valid:
            raise _gpu.cuda_error("device_allocation::free", _gpu.INVALID_HANDLE)
        self._valid = False
        _cleanup(
            self._ward, "device_allocation", lambda: self._ward.gpu.release(self._region.address)
        )

    def __del__(self) -> None:  # pycuda frees in the C++ destructor, on whatever thread
        if getattr(self, "_valid", False):
            self.free()


class PagelockedHostAllocation(bytearray):
    """``array.base`` of ``pagelocked_empty``: ``free()``, ``get_device_pointer()``."""

    def __init__(self, nbytes: int, flags: int, ward: Context) -> None:
        super().__init__(nbytes)
        self._flags = flags
        self._ward = ward
        kind = "mapped" if flags & host_alloc_flags.DEVICEMAP else "pinned"
        self._region = ward.gpu.allocate(
            nbytes, kind, "pagelocked", np.frombuffer(self, dtype=np.uint8)
        )
        self._valid = True

    def get_flags(self) -> int:
        return self._flags

    def get_device_pointer(self) -> int:
        _gpu.current().require_context("cuMemHostGetDevicePointer")
        if not self._flags & host_alloc_flags.DEVICEMAP:
            raise _gpu.cuda_error("cuMemHostGetDevicePointer", _gpu.INVALID_VALUE)
        return self._region.address

    def free(self) -> None:
        if not self._valid:
            raise _gpu.cuda_error("pagelocked_host_allocation::free", _gpu.INVALID_HANDLE)
        self._valid = False
        # Poisoned: a numpy view of freed page-locked memory reads garbage here, where on a
        # real host it reads unmapped memory (a crash) or whatever reused it.
        self[:] = b"\xff" * len(self)
        _cleanup(
            self._ward,
            "pagelocked_host_allocation",
            lambda: self._ward.gpu.release(self._region.address),
        )

    def __del__(self) -> None:
        if getattr(self, "_valid", False):
            self.free()


HostAllocation = PagelockedHostAllocation


def pagelocked_empty(
    shape: Any, dtype: Any, order: str = "C", mem_flags: int = 0
) -> np.ndarray[Any, Any]:
    gpu = _gpu.current()
    ward = gpu.require_context("cuMemHostAlloc")
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize
    allocation = PagelockedHostAllocation(nbytes, mem_flags, ward)
    return np.ndarray(dims, dtype=dtype, buffer=allocation, order=order)  # type: ignore[call-overload]


def mem_alloc(nbytes: int) -> DeviceAllocation:
    gpu = _gpu.current()
    ward = gpu.require_context("cuMemAlloc")
    return DeviceAllocation(gpu.allocate(int(nbytes), "device", "mem_alloc"), ward)


def mem_get_info() -> tuple[int, int]:
    gpu = _gpu.current()
    gpu.require_context("cuMemGetInfo")
    return gpu.total_memory - gpu.device_bytes, gpu.total_memory


class Stream:
    def __init__(self, flags: int = 0) -> None:
        gpu = _gpu.current()
        self._ward = gpu.require_context("cuStreamCreate")
        self._stream = gpu.new_stream()
        self._alive = True

    @property
    def handle(self) -> int:
        return self._stream.handle

    def synchronize(self) -> Stream:
        self._ward.gpu.require_context("cuStreamSynchronize")
        self._stream.run_pending()
        return self

    def is_done(self) -> bool:
        return not self._stream.pending

    def __del__(self) -> None:  # cuStreamDestroy in the C++ destructor
        if getattr(self, "_alive", False):
            self._alive = False
            _cleanup(self._ward, "stream", lambda: self._ward.gpu.drop_stream(self._stream.handle))


def _pointer(value: Any) -> int:
    return int(value)


def _pinned(array: Any) -> bool:
    """Is this buffer page-locked memory (a view of a pagelocked allocation)?"""
    base = array
    while base is not None:
        if isinstance(base, PagelockedHostAllocation):
            return True
        base = getattr(base, "base", None)
    return False


def _host_bytes(array: Any) -> np.ndarray[Any, Any]:
    view = np.asarray(array)
    if not view.flags.c_contiguous:
        raise LogicError("memcpy: the host buffer must be contiguous")
    return view.reshape(-1).view(np.uint8)


def _enqueue(stream: Stream | None, pinned: bool, work: Any) -> None:
    """Pinned + stream: queued until synchronize. Otherwise synchronous, as CUDA does for
    pageable memory and for the legacy default stream."""
    if stream is None or not pinned:
        work()
    else:
        stream._stream.enqueue(work)


def memcpy_htod_async(dest: Any, src: Any, stream: Stream | None = None) -> None:
    gpu = _gpu.current()
    gpu.require_context("cuMemcpyHtoDAsync")
    source = _host_bytes(src)
    pointer, nbytes = _pointer(dest), source.nbytes
    gpu.view(pointer, nbytes)  # a bad pointer fails at the call (CUDA_ERROR_INVALID_VALUE)

    def work() -> None:
        gpu.view(pointer, nbytes)[...] = source

    _enqueue(stream, _pinned(src), work)


def memcpy_dtoh_async(dest: Any, src: Any, stream: Stream | None = None) -> None:
    gpu = _gpu.current()
    gpu.require_context("cuMemcpyDtoHAsync")
    target = _host_bytes(dest)
    pointer, nbytes = _pointer(src), target.nbytes
    gpu.view(pointer, nbytes)

    def work() -> None:
        target[...] = gpu.view(pointer, nbytes)

    _enqueue(stream, _pinned(dest), work)


def _drain_all() -> None:
    """The legacy default stream waits for every other (blocking) stream."""
    for stream in list(_gpu.current().streams.values()):
        stream.run_pending()


def memcpy_htod(dest: Any, src: Any) -> None:
    _gpu.current().require_context("cuMemcpyHtoD")
    _drain_all()
    memcpy_htod_async(dest, src, None)


def memcpy_dtoh(dest: Any, src: Any) -> None:
    _gpu.current().require_context("cuMemcpyDtoH")
    _drain_all()
    memcpy_dtoh_async(dest, src, None)
