"""A test double of the ``pycuda`` package: only ``pycuda.driver`` (see tests/fakes)."""

from tests.fakes.pycuda import driver

VERSION = (2024, 1, 2)
VERSION_TEXT = "2024.1.2"

__all__ = ["VERSION", "VERSION_TEXT", "driver"]
