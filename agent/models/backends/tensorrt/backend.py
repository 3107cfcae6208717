"""Loading a plan: read it, deserialize it on the shared runtime, describe and probe it.

A failure at any step is a :class:`ModelLoadError` with TensorRT's own reason (taken from
the process logger), and the half-made engine is released at once, with the CUDA context
current, instead of living on in the traceback.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

from agent.models.backends.base import BackendOptions, ModelLoadError
from agent.models.backends.tensorrt.runtime import (
    SharedRuntime,
    TensorRTOptions,
    one_line,
    shared_runtime,
)
from agent.models.backends.tensorrt.session import TensorRTSession
from agent.models.backends.tensorrt.tensors import EngineTensor, describe_tensors, dims_of, volume

__all__ = ["MAX_PLAN_BYTES", "TensorRTBackend"]

log = logging.getLogger(__name__)

MAX_PLAN_BYTES = 4 * 1024**3  # larger than any engine a Jetson can hold


class TensorRTBackend:
    """Loads ``.plan`` / ``.engine`` files (serialized TensorRT engines)."""

    name: str = "tensorrt"

    def load(self, model_file: Path, options: BackendOptions) -> TensorRTSession:
        """Deserialize, describe and probe the engine; raise ModelLoadError with the reason."""
        trt_options = TensorRTOptions.from_extra(options.extra)
        shared = shared_runtime(trt_options)
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
                tensors = describe_tensors(shared.trt, engine)
                tensors = self._probe_outputs(shared, engine, tensors)
        except Exception as exc:
            # Release the engine now, with the context current: the traceback's frames would
            # otherwise keep it (and its device memory) alive for as long as the error lives.
            with shared.device.activate():
                traceback.clear_frames(exc.__traceback__)
                engine = None
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"{Path(model_file).name}: {one_line(exc)}") from exc
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
    def _probe_outputs(
        shared: SharedRuntime, engine: Any, tensors: list[EngineTensor]
    ) -> list[EngineTensor]:
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
                    shape = dims_of(context.get_tensor_shape(t.name))
                    if any(d < 0 for d in shape):
                        raise ModelLoadError(
                            f"output {t.name!r} has a data-dependent shape {list(shape)}, "
                            "which this backend does not support"
                        )
                    nbytes = volume(shape) * t.dtype.itemsize
                    largest[t.name] = max(largest.get(t.name, 0), nbytes)
            stream.synchronize()
        finally:
            del context
        return [
            t if t.is_input else EngineTensor(t.name, False, t.dtype, t.shape, (), largest[t.name])
            for t in tensors
        ]
