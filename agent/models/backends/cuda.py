"""CUDA through pycuda: one retained primary context, pushed per thread; streams; buffers.

Why this module exists: pycuda's contexts are a per-thread stack. A context made current on
the loading thread is *not* current on the ``infer-worker-N`` threads, and every pycuda
call there fails with ``invalid device context`` — or, worse, a buffer freed on a thread
where its context is not current is silently leaked (pycuda only warns "could not be
cleaned up"). So:

* the device's primary context (the one the CUDA runtime, and therefore TensorRT, uses) is
  retained once per process (:func:`get_device`) and never created per model;
* every thread that touches CUDA wraps the work in ``with device.activate():`` (push, pop);
* each thread gets one stream (:meth:`CudaDevice.stream`), reused for its whole life;
* buffers come from a :class:`BufferPool` that is freed explicitly, while the context is
  current, at a known moment (never from ``__del__``).

``pycuda`` is imported on first use (never ``pycuda.autoinit``, which makes a context of its
own on the importing thread).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from agent.models.backends.base import one_line

__all__ = [
    "PYCUDA_HINT",
    "BufferPool",
    "CudaDevice",
    "CudaError",
    "DeviceIdentity",
    "HostDeviceBuffer",
    "call_each",
    "free_each",
    "get_device",
    "import_driver",
    "release_device",
]

log = logging.getLogger(__name__)

PYCUDA_HINT = (
    "pycuda is not importable: pip install pycuda (it compiles against the CUDA toolkit: "
    "on Jetson put /usr/local/cuda/bin on PATH first; see docs/jetson.md)"
)

# Device allocations are rounded up to this: TensorRT wants 256-byte aligned tensors, and
# cuMemAlloc refuses 0 bytes.
ALIGNMENT = 256


class CudaError(RuntimeError):
    """CUDA could not be used (no driver, no device, out of memory); one line."""


@dataclass(frozen=True)
class DeviceIdentity:
    """What an engine is specific to: a plan built for one GPU does not load on another."""

    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    integrated: bool

    @property
    def slug(self) -> str:
        """A file-name-safe token such as ``orin-sm87``."""
        cleaned = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        major, minor = self.compute_capability
        return f"{cleaned or 'gpu'}-sm{major}{minor}"


def import_driver() -> Any:
    """``pycuda.driver``, or :class:`CudaError` with the install hint."""
    try:
        return importlib.import_module("pycuda.driver")
    except ImportError as exc:
        raise CudaError(f"{PYCUDA_HINT} ({exc})") from exc


def _aligned(nbytes: int) -> int:
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def size_class(nbytes: int) -> int:
    """The allocation for `nbytes`: rounded up to an eighth of the next power of two (so at
    most a quarter more than asked), and to ALIGNMENT."""
    wanted = max(nbytes, ALIGNMENT)
    step = max(ALIGNMENT, (1 << (wanted - 1).bit_length()) // 8)
    return -(-wanted // step) * step


def call_each(calls: Iterable[Callable[[], object]]) -> None:
    """Call every one, even when one of them fails; re-raise the first failure after (what
    releasing several pieces of GPU memory must do)."""
    first: BaseException | None = None
    for call in calls:
        try:
            call()
        except Exception as exc:  # keep releasing the others
            first = first or exc
    if first is not None:
        raise first


def free_each(memory: Iterable[Any]) -> None:
    """`free()` every one (`call_each`). Call with the context current."""
    call_each(item.free for item in memory)


class HostDeviceBuffer:
    """One tensor's memory: a page-locked host staging buffer and its device twin.

    With ``mapped`` (zero-copy) the host buffer is mapped into the device address space and
    there is no device twin: the GPU reads and writes host memory directly. On Jetson,
    where host and device share the same DRAM, that saves the copies; whether it is faster
    depends on the access pattern (mapped memory is uncached for the GPU), so it is an
    option to measure, not the default.

    Without ``host`` there is no host half at all: device memory only the GPU touches (an
    execution context's activations, decision 0038), never mapped.
    """

    def __init__(self, driver: Any, nbytes: int, *, mapped: bool, host: bool = True) -> None:
        self.nbytes = _aligned(nbytes)
        self.mapped = mapped and host
        self._driver = driver
        flags = driver.host_alloc_flags.DEVICEMAP if self.mapped else 0
        self.host: npt.NDArray[np.uint8] = (
            driver.pagelocked_empty(self.nbytes, np.uint8, mem_flags=flags)
            if host
            else np.empty(0, np.uint8)
        )
        # pycuda's HostAllocation (free() it); None: no host half
        self._host_allocation: Any = cast(Any, self.host.base if host else None)
        self._device: Any = None
        try:
            if self.mapped:
                self.device_ptr = int(self._host_allocation.get_device_pointer())
            else:
                self._device = driver.mem_alloc(self.nbytes)
                self.device_ptr = int(self._device)
        except BaseException:
            if self._host_allocation is not None:
                self._host_allocation.free()
            raise
        self._freed = False

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory this buffer holds (0 when mapped)."""
        return 0 if self.mapped or self._freed else self.nbytes

    @property
    def host_bytes(self) -> int:
        return 0 if self._freed or self._host_allocation is None else self.nbytes

    def upload(self, array: npt.NDArray[Any], stream: Any) -> None:
        """Stage ``array`` in page-locked memory and enqueue the copy to the device.

        The staging copy is what makes the transfer truly asynchronous (CUDA copies from
        pageable memory synchronously) and lets the caller's array go at once.
        """
        nbytes = array.nbytes
        if nbytes > self.nbytes:
            raise CudaError(f"{nbytes} bytes do not fit a {self.nbytes}-byte buffer")
        staging = self.host[:nbytes]
        staging[...] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if not self.mapped and nbytes:
            self._driver.memcpy_htod_async(self.device_ptr, staging, stream)

    def download(self, nbytes: int, stream: Any) -> None:
        """Enqueue the copy of the first ``nbytes`` back to the staging buffer."""
        if nbytes > self.nbytes:
            raise CudaError(f"{nbytes} bytes do not fit a {self.nbytes}-byte buffer")
        if not self.mapped and nbytes:
            self._driver.memcpy_dtoh_async(self.host[:nbytes], self.device_ptr, stream)

    def read(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """A copy of the staged result (the buffer is reused by the next request).

        Call only after the stream was synchronized.
        """
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nbytes = count * dtype.itemsize
        result: npt.NDArray[Any] = self.host[:nbytes].view(dtype).reshape(shape).copy()
        return result

    def free(self) -> None:
        """Free both halves now. The caller has the context current (see module doc)."""
        if self._freed:
            return
        self._freed = True
        try:
            if self._device is not None:
                self._device.free()
        finally:
            self._device = None
            if self._host_allocation is not None:
                self._host_allocation.free()


# A context's buffer more than twice what any of its runs of the last TRIM_AFTER_S asked is
# made again at the size they ask (docs/decisions/0037).
TRIM_AFTER_S = 30.0


class BufferPool:
    """The staging buffers of one execution context, by tensor name, sized by use.

    A tensor's buffer is made by the first run that needs it and grown (freed, then made
    again) by a run that needs more, to :func:`size_class` of what it asked, never beyond
    the `limit` the caller gives (the tensor's largest shape over every optimization
    profile). So a context holds what its largest recent run used, not the largest its
    engine allows: a decoder's logits at a whole context's prompt, or a cache tensor the
    session keeps on the device instead, cost nothing until a run needs them. After each
    run the session calls :meth:`trim`: every `TRIM_AFTER_S`, a buffer more than twice as
    large as its tensor's runs of that time asked is freed, to be made again at the size
    the next run asks (one long prompt does not hold its logits buffer for the context's
    life). Freed as a whole by :meth:`free_all`.
    """

    def __init__(
        self, driver: Any, *, mapped: bool, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._driver = driver
        self.mapped = mapped
        self._buffers: dict[str, HostDeviceBuffer] = {}
        self._clock = clock
        self._asked: dict[str, int] = {}  # the most each tensor's runs asked since `_since`
        self._since = clock()

    def fit(self, name: str, nbytes: int, limit: int, *, host: bool = True) -> HostDeviceBuffer:
        """`name`'s buffer, holding at least `nbytes` (made or grown now: call with the
        context current, and with no work in flight on the buffer it replaces); `host`: with
        a page-locked half (a name's buffers are always of one kind)."""
        self._asked[name] = max(self._asked.get(name, 0), nbytes)
        buffer = self._buffers.get(name)
        if buffer is not None and buffer.nbytes >= nbytes:
            return buffer
        if buffer is not None:
            del self._buffers[name]
            buffer.free()
        size = min(size_class(nbytes), max(_aligned(limit), _aligned(nbytes)))
        buffer = HostDeviceBuffer(self._driver, size, mapped=self.mapped, host=host)
        self._buffers[name] = buffer
        return buffer

    def trim(self) -> None:
        """After a run (the context current, no work in flight): once `TRIM_AFTER_S` passed
        since the last look, free the buffers more than twice as large as their tensors'
        runs asked meanwhile (unasked: any but the smallest)."""
        now = self._clock()
        if now - self._since < TRIM_AFTER_S:
            return
        asked, self._asked, self._since = self._asked, {}, now
        oversized = [
            name
            for name, buffer in self._buffers.items()
            if buffer.nbytes > 2 * size_class(asked.get(name, 0))
        ]
        for name in oversized:
            self._buffers.pop(name).free()

    def __getitem__(self, name: str) -> HostDeviceBuffer:
        return self._buffers[name]

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def device_bytes(self) -> int:
        """Any thread (a metrics scrape): summed over a snapshot, as the run's thread may
        be making or freeing a buffer meanwhile."""
        return sum(b.device_bytes for b in tuple(self._buffers.values()))

    @property
    def host_bytes(self) -> int:
        return sum(b.host_bytes for b in tuple(self._buffers.values()))

    def free_all(self) -> None:
        """Free every buffer, even when one of them fails; re-raise the first failure."""
        buffers, self._buffers = self._buffers, {}
        free_each(buffers.values())


class CudaDevice:
    """One GPU's retained primary context, shared by the whole process.

    The primary context is the one the CUDA runtime binds by default, so TensorRT (which
    uses the runtime API) and pycuda (driver API) work on the same context and may pass
    pointers and streams to each other.
    """

    def __init__(self, driver: Any, ordinal: int = 0) -> None:
        self._driver = driver
        self.ordinal = ordinal
        try:
            driver.init()
            count = int(driver.Device.count())
            if ordinal >= count:
                raise CudaError(f"CUDA device {ordinal} does not exist ({count} found)")
            self._device = driver.Device(ordinal)
            self._context = self._device.retain_primary_context()
        except CudaError:
            raise
        except Exception as exc:
            raise CudaError(f"cannot open CUDA device {ordinal}: {one_line(exc)}") from exc
        major, minor = self._device.compute_capability()
        self.identity = DeviceIdentity(
            name=str(self._device.name()),
            compute_capability=(int(major), int(minor)),
            total_memory=int(self._device.total_memory()),
            integrated=bool(self._device.get_attribute(driver.device_attribute.INTEGRATED)),
        )
        self._lock = threading.Lock()
        # thread ident -> (thread, stream); the thread object tells a dead owner apart.
        self._streams: dict[int, tuple[threading.Thread, Any]] = {}
        self._closed = False

    @property
    def driver(self) -> Any:
        return self._driver

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Make the primary context current in this thread for the block (push, then pop).

        Pushing per block, instead of once per thread, keeps the rule simple and local: any
        code that touches CUDA says so, and a thread never leaves a context behind.
        """
        if self._closed:
            raise CudaError("the CUDA device was released")
        self._context.push()
        try:
            yield
        finally:
            self._driver.Context.pop()

    def stream(self) -> Any:
        """This thread's stream, created on first use and reused for the thread's life.

        Call with the context current. Streams of threads that have ended are destroyed
        here, on the way, so a pool of short-lived threads does not pile up streams.
        """
        ident = threading.get_ident()
        with self._lock:
            entry = self._streams.get(ident)
            if entry is not None and entry[0] is threading.current_thread():
                return entry[1]
            dead = [k for k, (t, _) in self._streams.items() if not t.is_alive() or k == ident]
            stale = [self._streams.pop(k)[1] for k in dead]
        del stale  # destroyed here, with the context current (pycuda frees on release)
        stream = self._driver.Stream()
        with self._lock:
            self._streams[ident] = (threading.current_thread(), stream)
        return stream

    def buffer_pool(self, *, mapped: bool = False) -> BufferPool:
        """An empty pool; ``mapped`` asks for zero-copy host buffers (see HostDeviceBuffer)."""
        return BufferPool(self._driver, mapped=mapped)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory, as the driver reports them."""
        with self.activate():
            free, total = self._driver.mem_get_info()
        return int(free), int(total)

    def close(self) -> None:
        """Destroy the streams and release the primary context. Idempotent.

        Call when nothing on this device is in use any more (process shutdown, tests).
        """
        if self._closed:
            return
        with self.activate():
            with self._lock:
                streams, self._streams = self._streams, {}
            streams.clear()  # destroyed here, with the context current
        self._closed = True
        try:
            self._context.detach()
        except Exception as exc:
            log.warning(
                "CUDA device %d: releasing the primary context failed: %s", self.ordinal, exc
            )


_device: CudaDevice | None = None
_device_driver: Any = None
_device_lock = threading.Lock()


def get_device(ordinal: int = 0) -> CudaDevice:
    """The process-wide :class:`CudaDevice`; :class:`CudaError` if CUDA is unusable.

    One device per process: an agent that asks for a second ordinal gets an error rather
    than two primary contexts it would have to juggle per thread.
    """
    global _device, _device_driver
    driver = import_driver()
    with _device_lock:
        if _device is not None and _device_driver is not driver:
            _device = None  # pycuda was replaced (tests install a fake per test)
        if _device is None:
            _device = CudaDevice(driver, ordinal)
            _device_driver = driver
        elif _device.ordinal != ordinal:
            raise CudaError(
                f"this process already uses CUDA device {_device.ordinal}; "
                f"device {ordinal} would need a process of its own"
            )
        return _device


def release_device() -> None:
    """Close the process-wide device (streams, primary context), if one was opened."""
    global _device, _device_driver
    with _device_lock:
        device, _device, _device_driver = _device, None, None
    if device is not None:
        device.close()
