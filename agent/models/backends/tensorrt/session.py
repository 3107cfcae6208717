"""A deserialized TensorRT engine as a :class:`Session`: contexts, buffers, runs.

Execution contexts are created lazily, one per concurrent caller, and reused for the
session's life; a thread keeps "its" context. Each has its own page-locked + device buffers,
made and grown by the runs that need them (`agent.models.backends.cuda.BufferPool`): a
context holds what its largest run of the last half minute or so used, at most the largest
shape of every optimization profile, and nothing for a tensor read from or written to a
kept :class:`DeviceArray`; after minutes without a run, nothing (`release_idle`).
With ``activation_memory = "by_run"`` the context's activation memory is one more of them
(`.activations`). `.profiles` picks the optimization profile a context runs under. The CUDA
context is pushed around every block that touches the GPU, and ``close()`` releases
contexts, then the engine, then the buffers (deferred to the last running call at a drain
timeout).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt

from agent.models.backends import base, cuda
from agent.models.backends.base import InferenceError, TensorSpec
from agent.models.backends.device_arrays import DeviceArray, DevicePool
from agent.models.backends.tensorrt import activations
from agent.models.backends.tensorrt.profiles import Profiles
from agent.models.backends.tensorrt.runtime import (
    SharedRuntime,
    TensorRTOptions,
    one_line,
    tensorrt_version,
)
from agent.models.backends.tensorrt.tensors import EngineTensor, Shape, ShapeRange, dims_of, volume

__all__ = ["TensorRTSession"]

log = logging.getLogger(__name__)


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
        shared: SharedRuntime,
        engine: Any,
        tensors: Sequence[EngineTensor],
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
        self.version = str(getattr(self._trt, "__version__", "?"))
        # Before 8.6 a profile may be used by one live execution context at a time.
        self._profiles = Profiles(
            self._in,
            exclusive=tensorrt_version(self._trt) < (8, 6),
            version=self.version,
            failure=self._failure,
        )
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []  # every context of this session (strong refs)
        self._idle: list[_Worker] = []
        self._affinity = threading.local()  # weakref to the worker this thread used last
        self._active = 0
        self._last_run = time.monotonic()  # when the last run ended (or the session was made)
        self._closing = False
        self._closed = False
        self._kept = DevicePool(self._device)  # outputs kept on the device (`run_keeping`)
        # Activation memory given by each run (`.activations`), at most this much; 0: static.
        by_run = options.activation_memory == "by_run"
        self._activations_max = activations.engine_bytes(engine) if by_run else 0

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
        return self._profiles.ranges()

    @property
    def contexts(self) -> int:
        """Execution contexts created so far (one per concurrent caller)."""
        with self._lock:
            return len(self._workers)

    @property
    def device_bytes(self) -> int:
        """Device memory held by this session's buffers and kept outputs (not TensorRT's)."""
        with self._lock:
            buffers = sum(w.buffers.device_bytes for w in self._workers)
        return buffers + self._kept.device_bytes

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        """Run once; every failure is an :class:`InferenceError` with one line of reason."""
        return self.run_keeping(inputs, ())

    @property
    def keeps_on_device(self) -> bool:
        """Kept outputs stay on the GPU (`agent.models.backends.base.DeviceBinding`)."""
        return True

    def run_keeping(self, inputs: Mapping[str, Any], keep: Collection[str]) -> dict[str, Any]:
        """Run once; the outputs named in `keep` come back as :class:`DeviceArray`s, written
        there by TensorRT and read from there when given back as inputs (a decoder's cache:
        no copy to the host and back a token); the others as numpy arrays."""
        shapes = self._check_inputs(inputs)
        self._enter()
        try:
            with self._device.activate():
                return self._run_checked_out(inputs, shapes, keep)
        except InferenceError:
            raise
        except Exception as exc:
            raise InferenceError(f"TensorRT run failed: {one_line(exc)}") from exc
        finally:
            self._leave()

    def release_idle(self, idle_s: float | None = None) -> int:
        """When no run started or ended for `idle_s` (None: `IDLE_RELEASE_S`): free every
        context's staging buffers (device and page-locked) and the spare allocations of kept
        outputs; the next run makes what it needs again, and kept arrays still alive (a
        paused generation's cache) stay. The bytes freed. Runs wait meanwhile: nothing is
        freed under a run."""
        idle_s = base.IDLE_RELEASE_S if idle_s is None else idle_s
        with self._lock:
            if self._closing or self._active or time.monotonic() - self._last_run < idle_s:
                return 0
            staged = sum(w.buffers.device_bytes + w.buffers.host_bytes for w in self._workers)
            if not staged and not self._kept.spare_bytes:
                return 0
            with self._device.activate():
                for worker in self._workers:  # none is running: `_active` is 0
                    worker.buffers.free_all()
                freed = staged + self._kept.free_spares()
        log.info("%s: idle for %.0f s or more; released %d bytes of buffers", self, idle_s, freed)
        return freed

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
            if isinstance(array, DeviceArray) and not array.owned_by(self._kept):
                raise InferenceError(f"input {t.name!r} was kept by another session")
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
        self, inputs: Mapping[str, Any], shapes: Mapping[str, Shape], keep: Collection[str]
    ) -> dict[str, Any]:
        """Take a context, run, give it back; a context that failed oddly is discarded."""
        self._logger.take_errors()  # start this request with a clean slate
        worker = self._checkout()
        reusable = False
        try:
            result = self._execute(worker, inputs, shapes, keep)
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
        self,
        worker: _Worker,
        inputs: Mapping[str, Any],
        shapes: Mapping[str, Shape],
        keep: Collection[str],
    ) -> dict[str, Any]:
        """Shapes, copies in, launch, copies out, synchronize; the outputs as fresh arrays
        (those in `keep` as the device arrays TensorRT wrote them to)."""
        stream = self._device.stream()
        try:
            out_shapes = self._set_shapes(worker, shapes, stream)
            kept = self._launch(worker, inputs, out_shapes, stream, keep)
        finally:
            stream.synchronize()  # never leave work in flight on buffers we hand out again
        outputs = {
            t.name: kept[t.name]
            if t.name in kept
            else worker.buffers[t.name].read(t.dtype, out_shapes[t.name])
            for t in self._out
        }
        if keep:
            self._kept.trim()
        worker.buffers.trim()  # after the outputs were read out of them
        return outputs

    # worker.context is never bound to a local in these methods: a traceback kept after a
    # failed run must not keep the context (and through it the engine) alive past close().

    def _set_shapes(
        self, worker: _Worker, shapes: Mapping[str, Shape], stream: Any
    ) -> dict[str, Shape]:
        """Pick the profile, set every input shape, and read the output shapes TensorRT infers."""
        self._profiles.select(worker, shapes, stream)
        for t in self._in:
            if not worker.context.set_input_shape(t.name, shapes[t.name]):
                raise self._failure(f"input {t.name!r}: shape {list(shapes[t.name])} refused")
        unresolved = list(worker.context.infer_shapes())
        if unresolved:
            raise self._failure(f"shapes not resolved for {', '.join(map(str, unresolved))}")
        out_shapes = {t.name: dims_of(worker.context.get_tensor_shape(t.name)) for t in self._out}
        for t in self._out:
            shape = out_shapes[t.name]
            if any(d < 0 for d in shape) or volume(shape) * t.dtype.itemsize > t.max_bytes:
                raise InferenceError(
                    f"output {t.name!r} has shape {list(shape)}, beyond the largest the "
                    f"engine's profiles give ({t.max_bytes} bytes)"
                )
        return out_shapes

    def _launch(
        self,
        worker: _Worker,
        inputs: Mapping[str, Any],
        out_shapes: Mapping[str, Shape],
        stream: Any,
        keep: Collection[str],
    ) -> dict[str, DeviceArray]:
        """Enqueue the input copies, the inference and the output copies on ``stream``; a
        device array given as an input is read where it is, a kept output written to a new
        one (returned): neither is copied."""
        addresses, kept = self._place(worker, inputs, out_shapes, keep)
        for t in self._in:
            value = inputs[t.name]
            if not isinstance(value, DeviceArray):
                worker.buffers[t.name].upload(value, stream)
        for t in self._tensors:
            if not worker.context.set_tensor_address(t.name, addresses[t.name]):
                raise self._failure(f"tensor {t.name!r}: address refused")
        if not worker.context.execute_async_v3(stream.handle):
            raise self._failure("execute_async_v3 failed")
        for t in self._out:
            if t.name not in kept:
                nbytes = volume(out_shapes[t.name]) * t.dtype.itemsize
                worker.buffers[t.name].download(nbytes, stream)
        return kept

    def _place(
        self,
        worker: _Worker,
        inputs: Mapping[str, Any],
        out_shapes: Mapping[str, Shape],
        keep: Collection[str],
    ) -> tuple[dict[str, int], dict[str, DeviceArray]]:
        """Every tensor's device address, and the kept outputs' new device arrays. A device
        array given as an input is read where it is; every other tensor gets its staging
        buffer, made or grown to this run's size first (before any copy is enqueued). Memory
        the device cannot give refuses this run with an InferenceError; the context stays
        sound and the next run tries again."""
        addresses: dict[str, int] = {}
        kept: dict[str, DeviceArray] = {}
        for t in self._tensors:
            if t.is_input and isinstance(inputs[t.name], DeviceArray):
                addresses[t.name] = inputs[t.name].ptr
                continue
            shape: Shape = tuple(inputs[t.name].shape) if t.is_input else out_shapes[t.name]
            nbytes = volume(shape) * t.dtype.itemsize
            try:
                if t.name in keep and not t.is_input:
                    kept[t.name] = self._kept.array(shape, t.dtype)
                    addresses[t.name] = kept[t.name].ptr
                else:
                    addresses[t.name] = worker.buffers.fit(t.name, nbytes, t.max_bytes).device_ptr
            except Exception as exc:
                kind = "input" if t.is_input else "output"
                raise InferenceError(
                    f"no device memory for {kind} {t.name!r} ({nbytes} bytes): {one_line(exc)}"
                ) from exc
        if self._activations_max:
            self._place_activations(worker)
        return addresses, kept

    def _place_activations(self, worker: _Worker) -> None:
        """The context's activation memory for this run (`.activations`), grown first."""
        nbytes = activations.run_bytes(worker, self._engine)
        try:
            buffer = worker.buffers.fit(
                activations.ACTIVATIONS, nbytes, self._activations_max, host=False
            )
        except Exception as exc:
            raise InferenceError(
                f"no device memory for the engine's activations ({nbytes} bytes): {one_line(exc)}"
            ) from exc
        activations.give(worker, buffer)

    def _failure(self, what: str) -> InferenceError:
        """An InferenceError carrying what TensorRT logged on this thread about it."""
        errors = self._logger.take_errors()
        reason = "; ".join(errors) if errors else "TensorRT logged no reason"
        return InferenceError(f"{what}: {reason}")

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
        """An execution context, its buffers made by its runs (the context is current: see
        run)."""
        context = activations.new_context(
            self._trt, self._engine, by_run=bool(self._activations_max)
        )
        if context is None:
            raise self._failure("cannot create an execution context")
        log.debug(
            "%s: execution context %d for %s",
            self.model_file,
            len(self._workers) + 1,
            threading.current_thread().name,
        )
        return _Worker(context, self._device.buffer_pool(mapped=self._options.zero_copy))

    def _discard(self, worker: _Worker) -> None:
        """Release a context that failed mid-run (a CUDA error may have left it unsound)."""
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        self._profiles.forget(worker)
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
            self._last_run = time.monotonic()
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
        self._profiles.clear()
        try:
            with self._device.activate():
                for worker in workers:
                    worker.context = None
                self._engine = None
                cuda.call_each([*(w.buffers.free_all for w in workers), self._kept.free_all])
        finally:
            log.debug("%s: released %d execution context(s)", self.model_file, len(workers))
