"""The process-wide side of the TensorRT backend, and the options a load is given.

One ``tensorrt`` import (:func:`import_tensorrt`, with the install hint when it is
missing), one logger (:func:`process_logger`: TensorRT keeps a single global logger, ours
records each thread's errors so a ``None`` result can say why), one ``trt.Runtime`` on the
CUDA device (:func:`shared_runtime`), and :func:`shutdown`, which releases them last.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.models.backends import cuda
from agent.models.backends.base import ModelLoadError

__all__ = [
    "TENSORRT_HINT",
    "SharedRuntime",
    "TensorRTOptions",
    "import_tensorrt",
    "one_line",
    "process_logger",
    "shared_runtime",
    "shutdown",
    "tensorrt_version",
]

trt_log = logging.getLogger("agent.models.backends.tensorrt.trt")  # TensorRT's own messages

TENSORRT_HINT = (
    "tensorrt is not importable: on Jetson it comes with JetPack "
    "(sudo apt install python3-libnvinfer), elsewhere pip install tensorrt; see docs/jetson.md"
)

_ERRORS_KEPT = 8


# --------------------------------------------------------------------------- options


ACTIVATION_MEMORY = ("static", "by_run")  # `activation_memory`: who gives a context its own


@dataclass(frozen=True)
class TensorRTOptions:
    """The keys this backend reads from ``BackendOptions.extra["tensorrt"]``.

    ``device``: CUDA device ordinal (one per process). ``zero_copy``: mapped host buffers
    instead of device buffers plus copies (for Jetson's shared memory; measure first).
    ``activation_memory``: ``"static"``, TensorRT gives each execution context the memory
    of the engine's largest profile when it is made, for its life; ``"by_run"``, the agent
    gives each run what its profile (its shapes, for an engine built to allow it) needs,
    kept and freed as the staging buffers are (decision 0038).
    """

    device: int = 0
    zero_copy: bool = False
    activation_memory: str = "static"

    @staticmethod
    def table(extra: Mapping[str, object]) -> Mapping[str, Any]:
        """``extra["tensorrt"]`` (empty when not set); ModelLoadError if it is not a table."""
        raw = extra.get("tensorrt", {})
        if not isinstance(raw, Mapping):
            raise ModelLoadError("backend option 'tensorrt' must be a table")
        return raw

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> TensorRTOptions:
        """Validate at once, with the key named: a typo must not silently mean "default"."""
        raw = cls.table(extra)
        # `build`: how the agent builds an engine from ONNX (agent.models.engine_builds)
        unknown = sorted(set(raw) - {"device", "zero_copy", "activation_memory", "build"})
        if unknown:
            raise ModelLoadError(
                f"unknown tensorrt option(s) {', '.join(map(str, unknown))} "
                "(known: device, zero_copy, activation_memory, build)"
            )
        device = raw.get("device", 0)
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ModelLoadError(f"tensorrt.device must be an integer >= 0, got {device!r}")
        zero_copy = raw.get("zero_copy", False)
        if not isinstance(zero_copy, bool):
            raise ModelLoadError(f"tensorrt.zero_copy must be true or false, got {zero_copy!r}")
        activation_memory = raw.get("activation_memory", "static")
        if activation_memory not in ACTIVATION_MEMORY:
            raise ModelLoadError(
                "tensorrt.activation_memory must be one of "
                f"{', '.join(map(repr, ACTIVATION_MEMORY))}, got {activation_memory!r}"
            )
        return cls(device=device, zero_copy=zero_copy, activation_memory=str(activation_memory))


# --------------------------------------------------------------------------- process-wide


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or :class:`ModelLoadError` with the install hint."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as exc:
        raise ModelLoadError(f"{TENSORRT_HINT} ({exc})") from exc


def tensorrt_version(trt: Any) -> tuple[int, int]:
    """(major, minor) of a loaded ``tensorrt`` module."""
    parts = str(getattr(trt, "__version__", "0.0")).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return 0, 0


def one_line(text: object) -> str:
    squashed = " ".join(str(text).split())
    return squashed or "no reason given"


def _make_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that forwards to Python logging and keeps each thread's errors."""

    class CapturingLogger(trt.ILogger):  # type: ignore[misc, name-defined, unused-ignore]
        """TensorRT calls ``log`` on the thread that made the failing call (and, while
        building, on its own threads): errors are kept per thread, plus the last few of
        any thread, so a ``None`` result can be explained."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self._local = threading.local()
            self.recent: deque[str] = deque(maxlen=_ERRORS_KEPT)

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)
            text = one_line(msg)
            if level <= 1:  # INTERNAL_ERROR, ERROR
                trt_log.error("%s", text)
                errors = getattr(self._local, "errors", None)
                if errors is None:
                    errors = self._local.errors = deque(maxlen=_ERRORS_KEPT)
                errors.append(text)
                self.recent.append(text)
            elif level == 2:
                trt_log.warning("%s", text)
            elif level == 3:
                trt_log.debug("%s", text)

        def take_errors(self) -> list[str]:
            """This thread's errors since the last call, oldest first."""
            errors = getattr(self._local, "errors", None)
            if not errors:
                return []
            taken = list(errors)
            errors.clear()
            return taken

    return CapturingLogger()


_logger: Any = None
_logger_trt: Any = None
_logger_lock = threading.Lock()


def process_logger(trt: Any) -> Any:
    """The one TensorRT logger of this process (the engine builder uses it too).

    TensorRT keeps one global logger: a second, different logger passed to a Builder or
    Runtime is ignored with a warning, so sharing ours is the only way to see the errors.
    """
    global _logger, _logger_trt
    with _logger_lock:
        if _logger is None or _logger_trt is not trt:
            _logger, _logger_trt = _make_logger(trt), trt
        return _logger


@dataclass
class SharedRuntime:
    trt: Any
    logger: Any
    runtime: Any
    device: cuda.CudaDevice


_shared: SharedRuntime | None = None
_shared_lock = threading.Lock()


def _open_device(ordinal: int) -> cuda.CudaDevice:
    try:
        return cuda.get_device(ordinal)
    except cuda.CudaError as exc:
        raise ModelLoadError(str(exc)) from exc


def shared_runtime(options: TensorRTOptions) -> SharedRuntime:
    """The process-wide runtime, created on first load with the CUDA context current."""
    global _shared
    trt = import_tensorrt()
    device = _open_device(options.device)
    with _shared_lock:
        if _shared is not None and _shared.trt is trt and _shared.device is device:
            return _shared
        logger = process_logger(trt)
        try:
            with device.activate():
                trt.init_libnvinfer_plugins(logger, "")
                runtime = trt.Runtime(logger)
        except Exception as exc:
            raise ModelLoadError(f"cannot start the TensorRT runtime: {one_line(exc)}") from exc
        _shared = SharedRuntime(trt=trt, logger=logger, runtime=runtime, device=device)
        return _shared


def shutdown() -> None:
    """Release the process-wide runtime and the CUDA device, once every session is closed.

    For a clean process exit and for tests; loading again afterwards starts afresh.
    """
    global _shared
    with _shared_lock:
        shared, _shared = _shared, None
    if shared is not None:
        with shared.device.activate():
            shared.runtime = None
    cuda.release_device()
