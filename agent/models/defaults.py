"""`[defaults]`: an input's value when a request leaves it out, as the model's own tensor.

A window model takes constants besides its signal (silero-vad's scalar `sr`); requests need
not repeat them. The config gives plain TOML values; their dtype and shape come from the
model's signature, so they can only be checked once the model is loaded: a value that does
not fit (a float for an int64 input, text for a number, a boolean for a float, an array of
the wrong fixed shape) fails the version with one line (:func:`default_problems`, run by
`agent.models.signature.check_signature`).

Shapes: a scalar value fills the input's declared shape, a symbolic dim being 1 (silero's
rank-0 `sr` is a scalar); an array value must have the input's rank and its fixed dims, and
gives the symbolic ones their size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.models.backends.base import Array, TensorSpec

__all__ = ["default_arrays", "default_problems", "with_defaults"]


def default_problems(defaults: Mapping[str, Any], specs: Sequence[TensorSpec]) -> list[str]:
    """What in `[defaults]` does not fit the model's inputs; empty when all fits."""
    by_name = {spec.name: spec for spec in specs}
    problems = []
    for name, value in defaults.items():
        spec = by_name.get(name)
        if spec is None:
            problems.append(
                f"[defaults] {name}: not a model input (it has {', '.join(by_name) or 'none'})"
            )
            continue
        problem = _fit_problem(spec, value)
        if problem is not None:
            problems.append(f"[defaults] {name}: {problem}")
    return problems


def default_arrays(defaults: Mapping[str, Any], specs: Sequence[TensorSpec]) -> dict[str, Array]:
    """The `[defaults]` values as the model's inputs (checked ones: see default_problems),
    read-only: every request shares them."""
    arrays: dict[str, Array] = {}
    for spec in specs:
        if spec.name in defaults:
            array = _as_array(spec, defaults[spec.name])
            array.flags.writeable = False
            arrays[spec.name] = array
    return arrays


def with_defaults(inputs: Mapping[str, Array], defaults: Mapping[str, Array]) -> dict[str, Array]:
    """`inputs` with the defaulted inputs they lack (a request's own value wins)."""
    full = dict(inputs)
    for name, value in defaults.items():
        full.setdefault(name, value)
    return full


def _as_array(spec: TensorSpec, value: Any) -> Array:
    dtype = np.dtype(spec.dtype)
    if isinstance(value, list):
        return np.array(value, dtype=dtype)
    shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
    return np.full(shape, value, dtype=dtype)


def _fit_problem(spec: TensorSpec, value: Any) -> str | None:
    """Why `value` cannot be `spec`'s tensor (None: it can)."""
    if not spec.is_tensor or (not spec.is_numeric and spec.onnx_type != "tensor(string)"):
        return f"the input is {spec.onnx_type}, which a default cannot give"
    items = list(np.array(value, dtype=object).flat) if isinstance(value, list) else [value]
    dtype = np.dtype(spec.dtype)
    bad = next((item for item in items if not _fits_dtype(item, dtype)), None)
    if bad is not None:
        return f"{bad!r} does not fit the input's type {_type_name(spec)}"
    if isinstance(value, list):
        shape = np.array(value, dtype=object).shape
        if len(shape) != spec.rank or any(
            isinstance(d, int) and d != n for d, n in zip(spec.shape, shape, strict=True)
        ):
            return f"an array of shape {list(shape)} does not fit {spec.describe()}"
    return None


def _fits_dtype(item: Any, dtype: np.dtype[Any]) -> bool:
    kind = dtype.kind
    if kind == "b":
        return isinstance(item, bool)
    if kind == "O":
        return isinstance(item, str)
    if isinstance(item, bool) or not isinstance(item, int | float):
        return False
    if kind in "iu":
        info = np.iinfo(dtype)
        return isinstance(item, int) and info.min <= item <= info.max
    return kind == "f"


def _type_name(spec: TensorSpec) -> str:
    return "string" if np.dtype(spec.dtype).kind == "O" else np.dtype(spec.dtype).name
