"""Test doubles of ``tensorrt`` and ``pycuda`` for machines without a GPU.

Never installed globally: :func:`install` puts them into ``sys.modules`` through pytest's
``monkeypatch`` (undone after the test), and the :func:`fake_gpu` fixture does that plus
the cleanup checks. Use it from a test module with::

    from tests.fakes import fake_gpu  # noqa: F401  (a pytest fixture)

    def test_something(fake_gpu: FakeGPU) -> None: ...

and pick a TensorRT version with ``@pytest.mark.parametrize("fake_gpu", ["8.6.1"],
indirect=True)``. See ``_gpu.py`` for what the fake GPU records.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes import _gpu
from tests.fakes._gpu import FakeGPU

__all__ = ["FakeGPU", "fake_gpu", "install", "uninstall"]


def install(
    monkeypatch: pytest.MonkeyPatch,
    *,
    trt_version: str = "10.3.0",
    tensorrt: bool = True,
    pycuda: bool = True,
    **gpu: Any,
) -> FakeGPU:
    """A fresh fake GPU, with the fake modules in sys.modules (``False``: that module is
    made unimportable instead, to test the "not installed" paths)."""
    from tests.fakes import pycuda as fake_pycuda
    from tests.fakes import tensorrt as fake_tensorrt
    from tests.fakes.pycuda import driver as fake_driver

    device = FakeGPU(trt_version=trt_version, **gpu)
    _gpu.set_current(device)
    monkeypatch.setattr(fake_tensorrt, "__version__", trt_version)
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt if tensorrt else None)
    monkeypatch.setitem(sys.modules, "pycuda", fake_pycuda if pycuda else None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", fake_driver if pycuda else None)
    return device


def uninstall() -> None:
    """Release what the agent holds process-wide (runtime, device), then the fake GPU."""
    from agent.models.backends import cuda
    from agent.models.backends import tensorrt as backend

    try:
        backend.shutdown()
    finally:
        cuda.release_device()
        _gpu.set_current(None)


@pytest.fixture
def fake_gpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGPU]:
    """The fakes for one test; afterwards no thread may have a CUDA context left pushed."""
    version = getattr(request, "param", "10.3.0")
    device = install(monkeypatch, trt_version=version)
    try:
        yield device
        leftover = device.leftover_contexts()
        assert not leftover, f"CUDA contexts left pushed: {leftover}"
    finally:
        uninstall()
