"""Tensors kept on the GPU between runs: a decoder's cache under the agent's own TensorRT session.

The generate loop asks a device session to keep the `present.*` outputs where they were
made and gives them back as the next step's `past_key_values.*` (`run_keeping`,
`agent.models.backends.base.DeviceBinding`); ONNX Runtime's providers do it with their
`OrtValue`s. For TensorRT the kept values are :class:`DeviceArray`s: TensorRT writes a kept
output straight into one (its address set on the context) and reads a fed-back input from
it, so a token costs no copy of the cache to the host and back.

Memory: the generate loop drops a step's arrays when it has fed them back, at any moment and
on any thread, while CUDA memory may only be freed with the context current at a known
moment (`agent.models.backends.cuda`). So a dropped array's allocation goes back to its
:class:`DevicePool` (a queue append, no CUDA call), which reuses it for a later array of the
same size class (an eighth of a power of two, at most a quarter more than asked: a cache
that grows by one token a step reuses what the step before it left). After every run, `trim`
frees the spare allocations of the classes no run asked for in the last `KEEP_RUNS` runs (a
cache that grew into a larger class leaves its smaller ones behind), so what the pool holds
follows what the running requests use; `free_spares` frees every spare once the session is
idle, and `free_all` frees the rest when the session is released.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.backends.cuda import CudaDevice, CudaError, free_each, size_class

__all__ = ["DeviceArray", "DevicePool"]

KEEP_RUNS = 4  # spare allocations of a class no run asked for in this many runs are freed


class DeviceArray:
    """A tensor on the device (`shape`, `dtype`, its address `ptr`), from a :class:`DevicePool`.

    `numpy()` copies it to the host (lock-step batching pads caches there). Dropping it gives
    its memory back to the pool.
    """

    __slots__ = ("_allocation", "_pool", "_size", "dtype", "ptr", "shape")

    def __init__(
        self,
        pool: DevicePool,
        allocation: Any,
        size: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
    ) -> None:
        self._pool = pool
        self._allocation = allocation
        self._size = size
        self.shape = shape
        self.dtype = dtype
        self.ptr = int(allocation)

    def owned_by(self, pool: DevicePool) -> bool:
        return self._pool is pool

    def numpy(self) -> npt.NDArray[Any]:
        """A host copy (makes the context current itself)."""
        return self._pool.read(self)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.give_back(self._size, self._allocation)

    def __repr__(self) -> str:
        return f"<DeviceArray {list(self.shape)} {self.dtype} at {self.ptr:#x}>"


class DevicePool:
    """The device memory of one session's kept tensors, reused by size class; see the module."""

    def __init__(self, device: CudaDevice) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._free: dict[int, list[Any]] = {}
        # Given back by dropped arrays, on any thread and maybe inside a garbage collection
        # that interrupted this pool's own code: a deque append needs no lock (and so cannot
        # deadlock); `array` moves them to the free lists under the lock.
        self._returned: deque[tuple[int, Any]] = deque()
        self._held: dict[int, tuple[int, Any]] = {}  # id -> (size, allocation): all of them
        self._last_asked: dict[int, int] = {}  # size class -> the run that last asked for it
        self._runs = 0
        self._closed = False

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> DeviceArray:
        """A new array's memory (uninitialised). Call with the context current."""
        size = size_class(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        with self._lock:
            if self._closed:
                raise CudaError("the session's device memory was released")
            self._collect()
            self._last_asked[size] = self._runs
            free = self._free.get(size)
            allocation = free.pop() if free else None
            if allocation is None:
                allocation = self._device.driver.mem_alloc(size)
                self._held[id(allocation)] = (size, allocation)
        return DeviceArray(self, allocation, size, shape, dtype)

    def _collect(self) -> None:
        while self._returned:
            size, allocation = self._returned.popleft()
            self._free.setdefault(size, []).append(allocation)

    def trim(self) -> None:
        """After a run: free the spare allocations of classes not asked for in the last
        KEEP_RUNS runs. Call with the context current."""
        with self._lock:
            self._runs += 1
            self._collect()
            stale = [s for s in self._free if self._runs - self._last_asked.get(s, 0) > KEEP_RUNS]
            freed = [a for s in stale for a in self._free.pop(s)]
            for size in stale:
                self._last_asked.pop(size, None)
            for allocation in freed:
                del self._held[id(allocation)]
        for allocation in freed:
            allocation.free()

    def free_spares(self) -> int:
        """Free every spare allocation (the session went idle: no run will reuse them soon);
        the bytes freed. Arrays still alive keep theirs. Call with the context current."""
        with self._lock:
            self._collect()
            spares = [a for allocations in self._free.values() for a in allocations]
            self._free.clear()
            freed = [self._held.pop(id(a)) for a in spares]
        free_each(allocation for _, allocation in freed)
        return sum(size for size, _ in freed)

    def give_back(self, size: int, allocation: Any) -> None:
        """A dropped array's memory (any thread; no CUDA call)."""
        if not self._closed:
            self._returned.append((size, allocation))

    def read(self, array: DeviceArray) -> npt.NDArray[Any]:
        host: npt.NDArray[Any] = np.empty(array.shape, array.dtype)
        if host.nbytes:
            with self._device.activate():
                self._device.driver.memcpy_dtoh(host, array.ptr)
        return host

    @property
    def device_bytes(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._held.values())

    @property
    def spare_bytes(self) -> int:
        """Of `device_bytes`, the allocations no live array holds (kept for reuse)."""
        with self._lock:
            self._collect()
            return sum(size * len(allocations) for size, allocations in self._free.items())

    def free_all(self) -> None:
        """Free every allocation, arrays still alive included (the session is gone). Call
        with the context current; re-raises the first failure after freeing the others."""
        with self._lock:
            self._closed = True
            held, self._held = list(self._held.values()), {}
            self._free.clear()
            self._returned.clear()
        free_each(allocation for _, allocation in held)
