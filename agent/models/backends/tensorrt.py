"""The TensorRT backend: serialized engines (``.plan`` / ``.engine``), TensorRT 8.5 to 10.x.

Only the name-based API that 8.5 introduced and 10.0 kept is used (``num_io_tensors``,
``get_tensor_*``, ``set_input_shape``, ``infer_shapes``, ``set_tensor_address``,
``execute_async_v3``); the binding-index API is gone in 10.0 and never touched here.

How memory and threads are handled (the parts that are easy to get wrong):

* One process-wide logger and one ``trt.Runtime`` (:func:`process_logger`). TensorRT keeps a
  single global logger anyway; ours records each thread's errors, so a failed call can say
  *why* (``deserialize_cuda_engine`` returns ``None`` with the reason only in the log).
* CUDA comes from :mod:`agent.models.backends.cuda`: the primary context is pushed around every
  block that touches the GPU, because the worker threads calling :meth:`run` are not the
  thread that loaded the engine, and :meth:`close` may run on yet another.
* Execution contexts are created lazily, one per concurrent caller, each with its own
  page-locked + device buffers sized to the largest shape of every optimization profile, and
  reused for the session's life. A thread keeps "its" context (thread-local affinity) so in
  steady state each ``infer-worker-N`` owns one context; an idle context (say, the one the
  warm-up made on the loading thread) is handed to the next thread that needs one.
* ``close()`` releases, with the CUDA context current: the execution contexts, then the
  engine, then the buffers. If requests are still running (only at a drain timeout), the
  last of them does it when it returns.

``tensorrt`` and ``pycuda`` are imported inside :meth:`TensorRTBackend.load`; a machine
without them gets a :class:`ModelLoadError` with the install hint, not an import error.
"""

from __future__ import annotations

import importlib
import logging
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.backends import cuda
from agent.models.backends.base import (
    BackendOptions,
    Dim,
    InferenceError,
    ModelLoadError,
    TensorSpec,
)

__all__ = [
    "TENSORRT_HINT",
    "TensorRTBackend",
    "TensorRTOptions",
    "TensorRTSession",
    "import_tensorrt",
    "process_logger",
    "shutdown",
    "tensorrt_version",
]

log = logging.getLogger(__name__)
trt_log = logging.getLogger("agent.models.backends.tensorrt.trt")  # TensorRT's own messages

TENSORRT_HINT = (
    "tensorrt is not importable: on Jetson it comes with JetPack "
    "(sudo apt install python3-libnvinfer), elsewhere pip install tensorrt; see docs/jetson.md"
)

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

MAX_PLAN_BYTES = 4 * 1024**3  # larger than any engine a Jetson can hold
_ERRORS_KEPT = 8

Shape = tuple[int, ...]
ShapeRange = tuple[Shape, Shape, Shape]  # (min, opt, max) of one input in one profile


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class TensorRTOptions:
    """The keys this backend reads from ``BackendOptions.extra["tensorrt"]``.

    ``device``: CUDA device ordinal (one per process). ``zero_copy``: mapped host buffers
    instead of device buffers plus copies (for Jetson's shared memory; measure first).
    """

    device: int = 0
    zero_copy: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> TensorRTOptions:
        """Validate at once, with the key named: a typo must not silently mean "default"."""
        raw = extra.get("tensorrt", {})
        if not isinstance(raw, Mapping):
            raise ModelLoadError("backend option 'tensorrt' must be a table")
        unknown = sorted(set(raw) - {"device", "zero_copy"})
        if unknown:
            raise ModelLoadError(
                f"unknown tensorrt option(s) {', '.join(map(str, unknown))} "
                "(known: device, zero_copy)"
            )
        device = raw.get("device", 0)
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ModelLoadError(f"tensorrt.device must be an integer >= 0, got {device!r}")
        zero_copy = raw.get("zero_copy", False)
        if not isinstance(zero_copy, bool):
            raise ModelLoadError(f"tensorrt.zero_copy must be true or false, got {zero_copy!r}")
        return cls(device=device, zero_copy=zero_copy)


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


def _one_line(text: object) -> str:
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
            text = _one_line(msg)
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
class _Shared:
    trt: Any
    logger: Any
    runtime: Any
    device: cuda.CudaDevice


_shared: _Shared | None = None
_shared_lock = threading.Lock()


def _open_device(ordinal: int) -> cuda.CudaDevice:
    try:
        return cuda.get_device(ordinal)
    except cuda.CudaError as exc:
        raise ModelLoadError(str(exc)) from exc


def _shared_runtime(options: TensorRTOptions) -> _Shared:
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
            raise ModelLoadError(f"cannot start the TensorRT runtime: {_one_line(exc)}") from exc
        _shared = _Shared(trt=trt, logger=logger, runtime=runtime, device=device)
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


# --------------------------------------------------------------------------- engine I/O


@dataclass(frozen=True)
class _Tensor:
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


def _dims(dims: Any) -> Shape:
    """A ``trt.Dims`` as a tuple of ints (it is not a tuple, and ``len`` is its rank)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def _volume(shape: Shape) -> int:
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
        reported = [_dims(d) for d in engine.get_tensor_profile_shape(name, profile)]
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


def _describe(trt: Any, engine: Any) -> list[_Tensor]:
    """Every I/O tensor, inputs with their profile ranges; outputs sized later by probing."""
    profiles = int(engine.num_optimization_profiles)
    tensors: list[_Tensor] = []
    for index in range(int(engine.num_io_tensors)):
        name = str(engine.get_tensor_name(index))
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        if engine.is_shape_inference_io(name):
            raise ModelLoadError(
                f"tensor {name!r} is a shape tensor; engines with shape I/O are not supported"
            )
        dtype = _numpy_dtype(engine.get_tensor_dtype(name), name)
        shape = _dims(engine.get_tensor_shape(name))
        ranges: tuple[ShapeRange, ...] = ()
        max_bytes = _volume(shape) * dtype.itemsize
        if is_input:
            ranges = tuple(_profile_range(engine, name, p, shape) for p in range(profiles))
            max_bytes = max(_volume(r[2]) for r in ranges) * dtype.itemsize
        tensors.append(_Tensor(name, is_input, dtype, shape, ranges, max_bytes))
    if not any(t.is_input for t in tensors) or all(t.is_input for t in tensors):
        raise ModelLoadError("the engine needs at least one input and one output")
    return tensors


# --------------------------------------------------------------------------- the session


class _Worker:
    """One execution context with its buffers; used by one request at a time."""

    def __init__(self, context: Any, buffers: cuda.BufferPool) -> None:
        self.context: Any = context
        self.buffers = buffers
        self.profile: int | None = None  # not yet chosen: the first run sets it explicitly

    def __repr__(self) -> str:
        return f"<_Worker profile={self.profile} buffers={len(self.buffers)}>"


class TensorRTSession:
    """A deserialized engine. ``run`` may be called from several threads at once."""

    def __init__(
        self,
        shared: _Shared,
        engine: Any,
        tensors: Sequence[_Tensor],
        model_file: Path,
        options: TensorRTOptions,
    ) -> None:
        self.model_file = model_file
        self._shared = shared
        self._trt = shared.trt
        self._logger = shared.logger
        self._device = shared.device
        self._engine: Any = engine
        self._options = options
        self._tensors = tuple(tensors)
        self._in = tuple(t for t in tensors if t.is_input)
        self._out = tuple(t for t in tensors if not t.is_input)
        self._inputs = tuple(t.spec() for t in self._in)
        self._outputs = tuple(t.spec() for t in self._out)
        self._profiles = len(self._in[0].profiles)
        version = tensorrt_version(self._trt)
        # Before 8.6 a profile may be used by one live execution context at a time.
        self._exclusive_profiles = version < (8, 6)
        self.version = str(getattr(self._trt, "__version__", "?"))
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []  # every context of this session (strong refs)
        self._idle: list[_Worker] = []
        self._claims: dict[int, _Worker] = {}  # profile -> worker (exclusive mode only)
        self._affinity = threading.local()  # weakref to the worker this thread used last
        self._active = 0
        self._closing = False
        self._closed = False

    # -- the Session protocol ---------------------------------------------------------------

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        return self._outputs

    @property
    def providers(self) -> Sequence[str]:
        return ("TensorRT",)

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def profiles(self) -> tuple[dict[str, ShapeRange], ...]:
        """(min, opt, max) of every input, per optimization profile."""
        return tuple({t.name: t.profiles[p] for t in self._in} for p in range(self._profiles))

    @property
    def contexts(self) -> int:
        """Execution contexts created so far (one per concurrent caller)."""
        with self._lock:
            return len(self._workers)

    @property
    def device_bytes(self) -> int:
        """Device memory held by this session's buffers (not TensorRT's own)."""
        with self._lock:
            return sum(w.buffers.device_bytes for w in self._workers)

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        """Run once; every failure is an :class:`InferenceError` with one line of reason."""
        shapes = self._check_inputs(inputs)
        self._enter()
        try:
            with self._device.activate():
                return self._run_checked_out(inputs, shapes)
        except InferenceError:
            raise
        except Exception as exc:
            raise InferenceError(f"TensorRT run failed: {_one_line(exc)}") from exc
        finally:
            self._leave()

    def close(self) -> None:
        """Release contexts, engine and buffers now, or when the last running call returns."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            busy = self._active
        if busy:
            log.info("%s: %d request(s) still running; released when they finish", self, busy)
            return
        self._teardown()

    def __repr__(self) -> str:
        state = "closed" if self._closing else f"TensorRT {self.version}"
        return f"<TensorRTSession {self.model_file} {state}>"

    # -- one request ------------------------------------------------------------------------

    def _check_inputs(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, Shape]:
        """Names, dtypes and static dims, before any GPU work; the shapes by input name."""
        expected = {t.name for t in self._in}
        missing = sorted(expected - set(inputs))
        unknown = sorted(set(inputs) - expected)
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing input(s) {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown input(s) {', '.join(unknown)}")
            raise InferenceError("; ".join(parts))
        shapes: dict[str, Shape] = {}
        for t in self._in:
            array = inputs[t.name]
            if array.dtype != t.dtype:
                raise InferenceError(
                    f"input {t.name!r} is {array.dtype}, the engine takes {t.dtype}"
                )
            shape = tuple(int(d) for d in array.shape)
            if len(shape) != len(t.shape) or any(
                e >= 0 and e != s for e, s in zip(t.shape, shape, strict=True)
            ):
                raise InferenceError(
                    f"input {t.name!r} has shape {list(shape)}, the engine takes {list(t.shape)}"
                )
            shapes[t.name] = shape
        return shapes

    def _run_checked_out(
        self, inputs: Mapping[str, npt.NDArray[Any]], shapes: Mapping[str, Shape]
    ) -> dict[str, npt.NDArray[Any]]:
        """Take a context, run, give it back; a context that failed oddly is discarded."""
        self._logger.take_errors()  # start this request with a clean slate
        worker = self._checkout()
        reusable = False
        try:
            result = self._execute(worker, inputs, shapes)
            reusable = True
            return result
        except InferenceError:
            reusable = True  # refused by a check or by TensorRT before launching: still sound
            raise
        finally:
            if reusable:
                self._checkin(worker)
            else:
                self._discard(worker)

    def _execute(
        self, worker: _Worker, inputs: Mapping[str, npt.NDArray[Any]], shapes: Mapping[str, Shape]
    ) -> dict[str, npt.NDArray[Any]]:
        """Shapes, copies in, launch, copies out, synchronize; the outputs as fresh arrays."""
        stream = self._device.stream()
        try:
            out_shapes = self._set_shapes(worker, shapes, stream)
            self._launch(worker, inputs, out_shapes, stream)
        finally:
            stream.synchronize()  # never leave work in flight on buffers we hand out again
        return {t.name: worker.buffers[t.name].read(t.dtype, out_shapes[t.name]) for t in self._out}

    # worker.context is never bound to a local in these methods: a traceback kept after a
    # failed run must not keep the context (and through it the engine) alive past close().

    def _set_shapes(
        self, worker: _Worker, shapes: Mapping[str, Shape], stream: Any
    ) -> dict[str, Shape]:
        """Pick the profile, set every input shape, and read the output shapes TensorRT infers."""
        self._select_profile(worker, shapes, stream)
        for t in self._in:
            if not worker.context.set_input_shape(t.name, shapes[t.name]):
                raise self._failure(f"input {t.name!r}: shape {list(shapes[t.name])} refused")
        unresolved = list(worker.context.infer_shapes())
        if unresolved:
            raise self._failure(f"shapes not resolved for {', '.join(map(str, unresolved))}")
        out_shapes = {t.name: _dims(worker.context.get_tensor_shape(t.name)) for t in self._out}
        for t in self._out:
            shape = out_shapes[t.name]
            nbytes = _volume(shape) * t.dtype.itemsize
            if any(d < 0 for d in shape) or nbytes > worker.buffers[t.name].nbytes:
                raise InferenceError(
                    f"output {t.name!r} has shape {list(shape)}, beyond its buffer"
                )
        return out_shapes

    def _launch(
        self,
        worker: _Worker,
        inputs: Mapping[str, npt.NDArray[Any]],
        out_shapes: Mapping[str, Shape],
        stream: Any,
    ) -> None:
        """Enqueue the input copies, the inference and the output copies on ``stream``."""
        for t in self._in:
            worker.buffers[t.name].upload(inputs[t.name], stream)
        for t in self._tensors:
            if not worker.context.set_tensor_address(t.name, worker.buffers[t.name].device_ptr):
                raise self._failure(f"tensor {t.name!r}: address refused")
        if not worker.context.execute_async_v3(stream.handle):
            raise self._failure("execute_async_v3 failed")
        for t in self._out:
            worker.buffers[t.name].download(_volume(out_shapes[t.name]) * t.dtype.itemsize, stream)

    def _failure(self, what: str) -> InferenceError:
        """An InferenceError carrying what TensorRT logged on this thread about it."""
        errors = self._logger.take_errors()
        reason = "; ".join(errors) if errors else "TensorRT logged no reason"
        return InferenceError(f"{what}: {reason}")

    # -- optimization profiles --------------------------------------------------------------

    def _admitting(self, shapes: Mapping[str, Shape]) -> list[int]:
        def fits(profile: int) -> bool:
            for t in self._in:
                low, _, high = t.profiles[profile]
                shape = shapes[t.name]
                if any(not lo <= s <= hi for lo, s, hi in zip(low, shape, high, strict=True)):
                    return False
            return True

        return [p for p in range(self._profiles) if fits(p)]

    def _describe_profiles(self) -> str:
        parts = []
        for p in range(self._profiles):
            ranges = ", ".join(
                f"{t.name} {list(t.profiles[p][0])}..{list(t.profiles[p][2])}" for t in self._in
            )
            parts.append(f"profile {p}: {ranges}")
        return "; ".join(parts)

    def _select_profile(self, worker: _Worker, shapes: Mapping[str, Shape], stream: Any) -> None:
        """Keep the context's profile when it admits the shapes, else switch to one that does."""
        admitting = self._admitting(shapes)
        if not admitting:
            given = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
            raise InferenceError(
                f"input shapes ({given}) fit no optimization profile ({self._describe_profiles()})"
            )
        if worker.profile in admitting:
            return
        profile = self._claim(worker, admitting)
        try:
            switched = worker.context.set_optimization_profile_async(profile, stream.handle)
        except RuntimeError as exc:
            self._unclaim(worker, profile)
            raise self._failure(f"optimization profile {profile}: {_one_line(exc)}") from exc
        if not switched:
            self._unclaim(worker, profile)
            raise self._failure(f"optimization profile {profile} refused")
        if worker.profile is not None:
            self._unclaim(worker, worker.profile)
        worker.profile = profile

    def _claim(self, worker: _Worker, admitting: Sequence[int]) -> int:
        """The profile to use; before TensorRT 8.6 one that no other context holds."""
        if not self._exclusive_profiles:
            return admitting[0]
        with self._lock:
            for profile in admitting:
                if self._claims.get(profile, worker) is worker:
                    self._claims[profile] = worker
                    return profile
        raise InferenceError(
            f"optimization profile(s) {list(admitting)} are held by other workers' contexts; "
            f"TensorRT {self.version} lets one context use a profile at a time: build the "
            "engine with one profile per worker"
        )

    def _unclaim(self, worker: _Worker, profile: int) -> None:
        with self._lock:
            if self._claims.get(profile) is worker:
                del self._claims[profile]

    # -- contexts ---------------------------------------------------------------------------

    def _checkout(self) -> _Worker:
        """This thread's context if idle, else any idle one, else a new one."""
        ref = getattr(self._affinity, "worker", None)
        preferred: _Worker | None = ref() if ref is not None else None
        with self._lock:
            if preferred is not None and preferred in self._idle:
                self._idle.remove(preferred)
                return preferred
            if self._idle:
                worker = self._idle.pop()
                self._affinity.worker = weakref.ref(worker)
                return worker
        worker = self._new_worker()
        with self._lock:
            self._workers.append(worker)
        self._affinity.worker = weakref.ref(worker)
        return worker

    def _checkin(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _new_worker(self) -> _Worker:
        """An execution context and its buffers (the context is current: see run)."""
        context = self._engine.create_execution_context()
        if context is None:
            raise self._failure("cannot create an execution context")
        pool = self._device.buffer_pool(mapped=self._options.zero_copy)
        try:
            for t in self._tensors:
                pool.allocate(t.name, t.max_bytes)
        except BaseException:
            context = None
            pool.free_all()
            raise
        log.debug(
            "%s: execution context %d for %s, %d bytes of buffers",
            self.model_file,
            len(self._workers) + 1,
            threading.current_thread().name,
            pool.device_bytes + pool.host_bytes,
        )
        return _Worker(context, pool)

    def _discard(self, worker: _Worker) -> None:
        """Release a context that failed mid-run (a CUDA error may have left it unsound)."""
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
            for profile in [p for p, w in self._claims.items() if w is worker]:
                del self._claims[profile]
        worker.context = None
        worker.buffers.free_all()

    # -- lifetime ---------------------------------------------------------------------------

    def _enter(self) -> None:
        with self._lock:
            if self._closing:
                raise InferenceError("session closed")
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            last = self._closing and self._active == 0 and not self._closed
        if last:
            try:
                self._teardown()
            except Exception:
                log.exception("%s: deferred release failed", self.model_file)

    def _teardown(self) -> None:
        """Contexts, then the engine, then the buffers, all with the CUDA context current.

        TensorRT objects are released by dropping the last reference (their Python
        ``__del__`` does nothing); a context keeps its engine alive, so contexts go first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers, self._idle = self._workers, [], []
            self._claims.clear()
        first: BaseException | None = None
        with self._device.activate():
            for worker in workers:
                worker.context = None
            self._engine = None
            for worker in workers:
                try:
                    worker.buffers.free_all()
                except Exception as exc:
                    first = first or exc
        log.debug("%s: released %d execution context(s)", self.model_file, len(workers))
        if first is not None:
            raise first


# --------------------------------------------------------------------------- the backend


class TensorRTBackend:
    """Loads ``.plan`` / ``.engine`` files (serialized TensorRT engines)."""

    name: str = "tensorrt"

    def load(self, model_file: Path, options: BackendOptions) -> TensorRTSession:
        """Deserialize, describe and probe the engine; raise ModelLoadError with the reason."""
        trt_options = TensorRTOptions.from_extra(options.extra)
        shared = _shared_runtime(trt_options)
        data = self._read(Path(model_file))
        engine: Any = None
        try:
            with shared.device.activate():
                shared.logger.take_errors()
                engine = shared.runtime.deserialize_cuda_engine(data)
                if engine is None:
                    errors = shared.logger.take_errors()
                    version = getattr(shared.trt, "__version__", "?")
                    raise ModelLoadError(
                        f"{Path(model_file).name}: TensorRT {version} "
                        f"cannot deserialize it ({'; '.join(errors) or 'no reason logged'}); "
                        "an engine only loads on the TensorRT version and GPU it was built for"
                    )
                tensors = _describe(shared.trt, engine)
                tensors = self._probe_outputs(shared, engine, tensors)
        except Exception as exc:
            # Release the engine now, with the context current: the traceback's frames would
            # otherwise keep it (and its device memory) alive for as long as the error lives.
            with shared.device.activate():
                traceback.clear_frames(exc.__traceback__)
                engine = None
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{Path(model_file).name}: {_one_line(exc)}") from exc
        session = TensorRTSession(shared, engine, tensors, Path(model_file), trt_options)
        log.info(
            "%s: TensorRT %s engine, %d profile(s), inputs %s",
            model_file,
            session.version,
            len(session.profiles),
            ", ".join(s.describe() for s in session.inputs),
        )
        return session

    @staticmethod
    def _read(path: Path) -> bytes:
        try:
            size = path.stat().st_size
            if size > MAX_PLAN_BYTES:
                raise ModelLoadError(f"{path.name}: {size} bytes, more than {MAX_PLAN_BYTES}")
            return path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc

    @staticmethod
    def _probe_outputs(shared: _Shared, engine: Any, tensors: list[_Tensor]) -> list[_Tensor]:
        """Size each output by running shape inference at every profile's maximum.

        This also proves at load time that a context can be created (its activation memory
        fits), instead of failing on the first request. Outputs whose shape depends on the
        data (-1 even with all inputs known) need an output allocator: refused here.
        """
        context = engine.create_execution_context()
        if context is None:
            errors = shared.logger.take_errors()
            raise ModelLoadError(
                f"cannot create an execution context ({'; '.join(errors) or 'no reason logged'})"
            )
        try:
            stream = shared.device.stream()
            inputs = [t for t in tensors if t.is_input]
            largest: dict[str, int] = {}
            for profile in range(len(inputs[0].profiles)):
                context.set_optimization_profile_async(profile, stream.handle)
                for t in inputs:
                    if not context.set_input_shape(t.name, t.profiles[profile][2]):
                        errors = shared.logger.take_errors()
                        raise ModelLoadError(f"profile {profile}: {'; '.join(errors)}")
                unresolved = list(context.infer_shapes())
                if unresolved:
                    raise ModelLoadError(f"shapes not resolved for {', '.join(unresolved)}")
                for t in tensors:
                    if t.is_input:
                        continue
                    shape = _dims(context.get_tensor_shape(t.name))
                    if any(d < 0 for d in shape):
                        raise ModelLoadError(
                            f"output {t.name!r} has a data-dependent shape {list(shape)}, "
                            "which this backend does not support"
                        )
                    nbytes = _volume(shape) * t.dtype.itemsize
                    largest[t.name] = max(largest.get(t.name, 0), nbytes)
            stream.synchronize()
        finally:
            del context
        return [
            t if t.is_input else _Tensor(t.name, False, t.dtype, t.shape, (), largest[t.name])
            for t in tensors
        ]
