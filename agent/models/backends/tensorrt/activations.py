"""An execution context's activation memory, where the agent gives it (decision 0038).

TensorRT needs device memory for the activations of a run. By default
(``activation_memory = "static"``) each execution context allocates it when it is made,
sized for the engine's largest optimization profile, and holds it for its life. With
``activation_memory = "by_run"`` the context is made without it:

* TensorRT 10: ``create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED)``;
  each run asks ``update_device_memory_size_for_shapes()`` once the profile and the input
  shapes are set: the profile's size, or the shapes' own where the engine was built with
  the ``RUNTIME_ACTIVATION_RESIZE_10_10`` preview feature;
* TensorRT 8.5/8.6: ``create_execution_context_without_device_memory()``, and every run gets
  the engine's ``device_memory_size``;

and the memory is given before the run is enqueued: ``set_device_memory(ptr, size)`` from
10.1, the write-only ``device_memory`` attribute before. It is one more buffer of the
context's pool (device only, no page-locked half), so it is grown, trimmed and released
when idle by the pool's rules, and counted in the session's device bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

from agent.models.backends.cuda import HostDeviceBuffer
from agent.models.backends.tensorrt.runtime import tensorrt_version

__all__ = ["ACTIVATIONS", "HasContext", "engine_bytes", "give", "new_context", "run_bytes"]

ACTIVATIONS = "\x00activations"  # its key among the context's buffers: no tensor's name


class HasContext(Protocol):
    """What holds an execution context (it is never bound to a local here: a traceback kept
    after a failure must not keep the context, and through it the engine, alive)."""

    context: Any


def new_context(trt: Any, engine: Any, *, by_run: bool) -> Any:
    """An execution context: with its own activation memory, or (`by_run`) without."""
    if not by_run:
        return engine.create_execution_context()
    if tensorrt_version(trt) >= (10, 0):
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        return engine.create_execution_context(strategy)
    return engine.create_execution_context_without_device_memory()


def engine_bytes(engine: Any) -> int:
    """The most any profile's runs need (10.1+: `device_memory_size_v2`, which counts the
    scratch memory of weight streaming too)."""
    size = getattr(engine, "device_memory_size_v2", None)
    return int(size if size is not None else engine.device_memory_size)


def run_bytes(holder: HasContext, engine: Any) -> int:
    """What the run about to be enqueued needs: its profile and input shapes are set. Where
    TensorRT cannot say (before 10.0, or 0: its error), the engine's most."""
    update = getattr(holder.context, "update_device_memory_size_for_shapes", None)
    size = int(update()) if update is not None else 0
    return size or engine_bytes(engine)


def give(holder: HasContext, buffer: HostDeviceBuffer) -> None:
    """Hand `buffer` to the context for its next run."""
    if hasattr(holder.context, "set_device_memory"):
        holder.context.set_device_memory(buffer.device_ptr, buffer.nbytes)
    else:
        holder.context.device_memory = buffer.device_ptr
