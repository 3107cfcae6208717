"""Backends by type key, imported only when first asked for (warm-up: agent.models.warmup).

A runtime that is not installed (TensorRT on a laptop, ONNX Runtime on a TensorRT-only box)
costs a :class:`ModelLoadError` for the versions that need it, never an import error at start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.models.backends.base import Backend, ModelLoadError

__all__ = ["BACKENDS", "SUFFIXES", "backend_for_file", "get_backend"]

# Model file suffix -> backend name. Which files a version folder may hold is the
# repository's business (agent.models.repository); this maps the ones it accepts.
SUFFIXES: dict[str, str] = {".onnx": "onnxruntime", ".plan": "tensorrt", ".engine": "tensorrt"}


def _onnxruntime() -> Backend:
    from agent.models.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend()


def _tensorrt() -> Backend:
    """agent.models.backends.tensorrt is optional (and needs tensorrt + pycuda); import it late."""
    try:
        module = importlib.import_module("agent.models.backends.tensorrt")
        factory: Callable[[], Any] = module.TensorRTBackend
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"backend 'tensorrt' is not available in this build ({exc})") from exc
    backend: Backend = factory()
    return backend


BACKENDS: dict[str, Callable[[], Backend]] = {
    "onnxruntime": _onnxruntime,
    "tensorrt": _tensorrt,
}


def get_backend(name: str) -> Backend:
    """A fresh backend for ``name``; ModelLoadError if unknown or not installed."""
    factory = BACKENDS.get(name)
    if factory is None:
        known = ", ".join(sorted(BACKENDS))
        raise ModelLoadError(f"unknown backend {name!r} (known: {known})")
    return factory()


def backend_for_file(path: Path | str) -> str:
    """The backend a model file's suffix implies (``.onnx``, ``.plan`` or ``.engine``)."""
    suffix = Path(path).suffix.lower()
    try:
        return SUFFIXES[suffix]
    except KeyError:
        raise ModelLoadError(
            f"{Path(path).name}: no backend for files ending in {suffix or '(no suffix)'!r}"
        ) from None
