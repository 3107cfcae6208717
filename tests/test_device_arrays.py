"""The TensorRT session's kept outputs (agent/models/backends/device_arrays.py): memory by size
class, given back when an array is dropped, reused, trimmed after runs, freed at the end.

Against the pycuda test double (tests/fakes), not on a GPU.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from agent.models.backends import cuda
from agent.models.backends.cuda import size_class
from agent.models.backends.device_arrays import KEEP_RUNS, DevicePool
from tests import fakes
from tests.fakes import FakeGPU

fake_gpu = fakes.fake_gpu  # the fixture

F32 = np.dtype(np.float32)


def allocated(gpu: FakeGPU) -> list[int]:
    return sorted(r.nbytes for r in gpu.live("device") if r.label == "mem_alloc")


def test_size_classes_waste_at_most_a_quarter() -> None:
    sizes = (0, 1, 256, 257, 4096, 4097, 5000, 1_000_000)
    assert [size_class(n) for n in sizes] == [256, 256, 256, 512, 4096, 5120, 5120, 1_048_576]
    for n in range(1, 300_000, 997):
        assert n <= size_class(n) <= max(256, n * 1.25)


def test_a_dropped_array_is_reused_then_trimmed_and_all_is_freed_at_the_end(
    fake_gpu: FakeGPU,
) -> None:
    device = cuda.get_device()
    pool = DevicePool(device)
    with device.activate():
        a = pool.array((1, 100), F32)  # 400 bytes: class 512
        data = np.arange(100, dtype=np.float32).reshape(1, 100)
        device.driver.memcpy_htod(a.ptr, data)
        np.testing.assert_array_equal(a.numpy(), data)
        address = a.ptr
        del a  # back to the pool, no CUDA call
        b = pool.array((1, 120), F32)  # 480 bytes: the same class, the same memory
        assert b.ptr == address and allocated(fake_gpu) == [512]
        big = pool.array((1, 1000), F32)  # 4000 bytes: class 4096
        del b
        for _ in range(KEEP_RUNS + 1):  # class 512 not asked for again: its spare goes
            pool.trim()
        assert allocated(fake_gpu) == [4096] and pool.device_bytes == 4096
        pool.free_all()
    assert allocated(fake_gpu) == []
    assert big.owned_by(pool)
    del big  # after free_all: nothing is given back, nothing fails
    gc.collect()


def test_arrays_dropped_on_other_threads_come_back(fake_gpu: FakeGPU) -> None:
    device = cuda.get_device()
    pool = DevicePool(device)
    with device.activate():
        arrays = [pool.array((64,), F32) for _ in range(8)]
    dropper = threading.Thread(target=arrays.clear, name="test-dropper")
    dropper.start()
    dropper.join()
    with device.activate():
        again = [pool.array((64,), F32) for _ in range(8)]
        assert len(allocated(fake_gpu)) == 8  # reused, not allocated again
        del again
        pool.free_all()
        with pytest.raises(cuda.CudaError, match="released"):
            pool.array((64,), F32)
    assert allocated(fake_gpu) == []


def test_an_idle_pool_frees_its_spares_and_keeps_the_arrays_alive(fake_gpu: FakeGPU) -> None:
    """`free_spares` (the session went idle): every allocation no live array holds is freed,
    whatever its class; a live array (a paused generation's cache) keeps its memory."""
    device = cuda.get_device()
    pool = DevicePool(device)
    with device.activate():
        kept = pool.array((1, 100), F32)  # class 512
        data = np.arange(100, dtype=np.float32).reshape(1, 100)
        device.driver.memcpy_htod(kept.ptr, data)
        dropped = [pool.array((1, 1000), F32), pool.array((1, 2000), F32)]  # 4096, 8192
        del dropped
        assert pool.spare_bytes == 4096 + 8192
        assert pool.free_spares() == 4096 + 8192
        assert allocated(fake_gpu) == [512] and pool.device_bytes == 512
        assert pool.spare_bytes == 0 and pool.free_spares() == 0
        np.testing.assert_array_equal(kept.numpy(), data)
        again = pool.array((1, 1000), F32)  # made again when asked
        assert allocated(fake_gpu) == [512, 4096]
        del again
        pool.free_all()
    assert allocated(fake_gpu) == []
