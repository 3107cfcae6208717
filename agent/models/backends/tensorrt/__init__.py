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
  page-locked + device buffers made and grown by its runs (never past the largest shape of
  every optimization profile), and reused for the session's life. A thread keeps "its"
  context (thread-local affinity) so in steady state each ``infer-worker-N`` owns one
  context; an idle context (say, the one the warm-up made on the loading thread) is handed
  to the next thread that needs one.
* ``close()`` releases, with the CUDA context current: the execution contexts, then the
  engine, then the buffers. If requests are still running (only at a drain timeout), the
  last of them does it when it returns.

``tensorrt`` and ``pycuda`` are imported inside :meth:`TensorRTBackend.load`; a machine
without them gets a :class:`ModelLoadError` with the install hint, not an import error.

Modules: :mod:`.runtime` (the import, the logger, the runtime, the options, ``shutdown``),
:mod:`.tensors` (the engine's I/O as TensorRT describes it), :mod:`.profiles` (which
optimization profile a context runs under), :mod:`.activations` (a context's activation
memory where the agent gives it), :mod:`.session` (contexts, buffers, one run),
:mod:`.backend` (reading, deserializing and probing a plan).
The service looks this package up by name (``agent.models.backends.tensorrt``) to call
:func:`shutdown` last, and the backend registry imports it only when a plan is loaded.
"""

from __future__ import annotations

from agent.models.backends.tensorrt.backend import TensorRTBackend
from agent.models.backends.tensorrt.runtime import (
    TENSORRT_HINT,
    TensorRTOptions,
    import_tensorrt,
    process_logger,
    shutdown,
    tensorrt_version,
)
from agent.models.backends.tensorrt.session import TensorRTSession

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
