"""The engine's I/O tensors as TensorRT describes them, and the shape arithmetic on them.

Names, numpy dtypes, shapes (-1 for a dynamic dimension), each input's (min, opt, max)
per optimization profile, and the most bytes each tensor can take (outputs are sized by
probing at load, in :mod:`agent.models.backends.tensorrt.backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.models.backends.base import Dim, ModelLoadError, TensorSpec

__all__ = [
    "TRT_DTYPES",
    "EngineTensor",
    "Shape",
    "ShapeRange",
    "describe_tensors",
    "dims_of",
    "volume",
]

# TensorRT DataType names -> the numpy types the agent carries. BF16, FP8 and INT4 have no
# numpy type the wire format knows; an engine with such I/O is refused at load.
TRT_DTYPES: dict[str, np.dtype[Any]] = {
    "FLOAT": np.dtype("float32"),
    "HALF": np.dtype("float16"),
    "INT8": np.dtype("int8"),
    "INT32": np.dtype("int32"),
    "INT64": np.dtype("int64"),
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("uint8"),
}

Shape = tuple[int, ...]
ShapeRange = tuple[Shape, Shape, Shape]  # (min, opt, max) of one input in one profile


@dataclass(frozen=True)
class EngineTensor:
    """One I/O tensor of the engine as TensorRT describes it (-1 = dynamic dimension)."""

    name: str
    is_input: bool
    dtype: np.dtype[Any]
    shape: Shape
    profiles: tuple[ShapeRange, ...]  # inputs only: (min, opt, max) per profile
    max_bytes: int

    def spec(self) -> TensorSpec:
        dims: tuple[Dim, ...] = tuple(d if d >= 0 else None for d in self.shape)
        return TensorSpec(name=self.name, dtype=self.dtype, shape=dims)


def dims_of(dims: Any) -> Shape:
    """A ``trt.Dims`` as a tuple of ints (it is not a tuple, and ``len`` is its rank)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def volume(shape: Shape) -> int:
    count = 1
    for d in shape:
        count *= max(d, 0)
    return count


def _numpy_dtype(trt_dtype: Any, name: str) -> np.dtype[Any]:
    key = str(getattr(trt_dtype, "name", trt_dtype)).rsplit(".", 1)[-1]
    dtype = TRT_DTYPES.get(key)
    if dtype is None:
        raise ModelLoadError(
            f"tensor {name!r} has TensorRT type {key}, which the agent cannot carry"
        )
    return dtype


def _profile_range(engine: Any, name: str, profile: int, shape: Shape) -> ShapeRange:
    """(min, opt, max) of ``name`` in ``profile``; a static input's own shape if TensorRT
    reports none for it."""
    try:
        reported = [dims_of(d) for d in engine.get_tensor_profile_shape(name, profile)]
    except Exception:
        reported = []
    valid = len(reported) == 3 and all(
        len(r) == len(shape) and all(d >= 0 for d in r) for r in reported
    )
    if valid:
        return reported[0], reported[1], reported[2]
    if all(d >= 0 for d in shape):
        return shape, shape, shape
    raise ModelLoadError(
        f"input {name!r} is dynamic {list(shape)} but profile {profile} has no shape"
    )


def describe_tensors(trt: Any, engine: Any) -> list[EngineTensor]:
    """Every I/O tensor, inputs with their profile ranges; outputs sized later by probing."""
    profiles = int(engine.num_optimization_profiles)
    tensors: list[EngineTensor] = []
    for index in range(int(engine.num_io_tensors)):
        name = str(engine.get_tensor_name(index))
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        if engine.is_shape_inference_io(name):
            raise ModelLoadError(
                f"tensor {name!r} is a shape tensor; engines with shape I/O are not supported"
            )
        dtype = _numpy_dtype(engine.get_tensor_dtype(name), name)
        shape = dims_of(engine.get_tensor_shape(name))
        ranges: tuple[ShapeRange, ...] = ()
        max_bytes = volume(shape) * dtype.itemsize
        if is_input:
            ranges = tuple(_profile_range(engine, name, p, shape) for p in range(profiles))
            max_bytes = max(volume(r[2]) for r in ranges) * dtype.itemsize
        tensors.append(EngineTensor(name, is_input, dtype, shape, ranges, max_bytes))
    if not any(t.is_input for t in tensors) or all(t.is_input for t in tensors):
        raise ModelLoadError("the engine needs at least one input and one output")
    return tensors
