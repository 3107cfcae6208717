"""A test double of the ``tensorrt`` Python module (8.5 to 10.x), for machines without a GPU.

Mirrored from the real bindings (NVIDIA/TensorRT python/src/infer/pyCore.cpp and the
NvInferRuntime.h comments of 8.5.3, 8.6.1 and 10.3.0), where the agent depends on it:

* names and return types: ``set_input_shape``, ``set_tensor_address`` and
  ``execute_async_v3`` return ``bool``; ``infer_shapes()`` returns the names it could not
  resolve; ``set_optimization_profile_async`` returns ``True`` or raises
  ``RuntimeError("Error in set optimization profile async.")``;
  ``Runtime.deserialize_cuda_engine`` returns ``None`` and says why only in the logger;
  ``Builder.build_serialized_network`` returns ``None`` likewise;
* ``-1`` in dynamic dims until the input shapes are set; ``trt.Dims`` is not a tuple;
* the binding-index API (``get_binding_index``, ``execute_async_v2``, ...) is absent from
  10.x (``AttributeError``) and deprecated before; ``IProgressMonitor`` exists from 10.0;
* before 8.6 an optimization profile may be used by one live execution context only;
* a context keeps its engine alive, an engine its runtime (pybind ``keep_alive``); objects
  are destroyed when the last reference goes, and the fake records whether a CUDA context
  was current at that moment;
* one global logger: a second, different logger is ignored with TensorRT's warning;
* activation memory: a context made by ``create_execution_context()`` (``STATIC``) holds the
  engine's ``device_memory_size``; one made with ``USER_MANAGED`` (10.x) or by
  ``create_execution_context_without_device_memory()`` (deprecated in 10.0) holds none and
  refuses to enqueue until ``device_memory`` (write-only) or ``set_device_memory(ptr, size)``
  (10.1+) gives it some; ``update_device_memory_size_for_shapes()`` (10.0+) returns the
  current profile's size (what TensorRT returns unless the engine was built with the
  ``RUNTIME_ACTIVATION_RESIZE_10_10`` preview feature, 10.10+: then the current shapes') and
  0 before every input shape is set. A run scribbles over its activation memory, so memory
  shared with a tensor shows.

The "plan" is a small header (TensorRT version, GPU, I/O, profiles, flags) plus the ONNX
model; the engine computes with ONNX Runtime on the CPU, so outputs can be compared.
Engine weights and activation memory are accounted as device memory of the fake GPU.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tests.fakes import _gpu

__version__ = "10.3.0"  # set by tests.fakes.install()

MAGIC = b"FTRT"
TIMING_MAGIC = b"FTRTTC1\n"
ACTIVATION_BYTES = 64 * 1024  # a profile's activation memory: this, plus ACTIVATION_PER_BYTE
ACTIVATION_PER_BYTE = 64  # times the bytes of its largest inputs


_RUNTIME_ACTIVATION_RESIZE = 2


class _PreviewFeature(enum.IntEnum):
    """Before 10.10 (reached as ``PreviewFeature`` through the module's ``__getattr__``)."""

    PROFILE_SHARING_0806 = 0
    ALIASED_PLUGIN_IO_10_03 = 1


class _PreviewFeature_10_10(enum.IntEnum):
    PROFILE_SHARING_0806 = 0
    ALIASED_PLUGIN_IO_10_03 = 1
    RUNTIME_ACTIVATION_RESIZE_10_10 = _RUNTIME_ACTIVATION_RESIZE


_PreviewFeature.__name__ = _PreviewFeature_10_10.__name__ = "PreviewFeature"


class ExecutionContextAllocationStrategy(enum.IntEnum):
    """10.0+ (reached through the module's ``__getattr__``)."""

    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


def _version() -> tuple[int, int]:
    return _gpu.current().trt


def _serialization_tag(version: tuple[int, int]) -> int:
    return {(8, 5): 213, (8, 6): 232, (10, 0): 236, (10, 3): 239}.get(
        version, 200 + version[0] * 4 + version[1]
    )


# --------------------------------------------------------------------------- logging


class ILogger:
    """Abstract logger; subclasses must call ``trt.ILogger.__init__(self)``."""

    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR = Severity.INTERNAL_ERROR
    ERROR = Severity.ERROR
    WARNING = Severity.WARNING
    INFO = Severity.INFO
    VERBOSE = Severity.VERBOSE

    def __init__(self) -> None:
        self._trt_initialised = True

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        raise NotImplementedError("ILogger.log is pure virtual")


class Logger(ILogger):
    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        ILogger.__init__(self)
        self.min_severity = min_severity

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        if severity <= self.min_severity:
            print(f"[TRT] [{severity.name[0]}] {msg}", file=sys.stderr)


def _adopt_logger(logger: Any, who: str) -> None:
    if not getattr(logger, "_trt_initialised", False):
        raise TypeError(
            f"{type(logger).__name__}.__init__() must be called when overriding __init__"
        )
    gpu = _gpu.current()
    if gpu.trt_logger is None:
        gpu.trt_logger = logger
    elif gpu.trt_logger is not logger:
        _log(
            ILogger.WARNING,
            f"The logger passed into {who} differs from one already provided for an existing "
            "builder, runtime, or refitter. Uses of the global logger, returned by "
            "nvinfer1::getLogger(), will return the existing value.",
        )


def _log(severity: ILogger.Severity, msg: str) -> None:
    logger = _gpu.current().trt_logger
    if logger is not None:
        logger.log(severity, msg)


def _error(code: int, kind: str, where: str, text: str) -> None:
    _log(ILogger.ERROR, f"{code}: [{where}] Error Code {code}: {kind} ({text})")


def init_libnvinfer_plugins(logger: Any, namespace: str) -> bool:
    return True


# --------------------------------------------------------------------------- types


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9

    @property
    def itemsize(self) -> int:
        return {"FLOAT": 4, "HALF": 2, "INT32": 4, "INT64": 8, "BF16": 2}.get(self.name, 1)


_NP = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
    DataType.INT64: np.int64,
    DataType.BOOL: np.bool_,
    DataType.UINT8: np.uint8,
}


def nptype(trt_type: DataType) -> Any:
    try:
        return _NP[trt_type]
    except KeyError:
        raise TypeError(
            "Could not resolve TensorRT datatype to an equivalent numpy datatype."
        ) from None


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class Dims:
    """``trt.Dims``: ``len`` is the rank, indexable, iterable; not a tuple."""

    MAX_DIMS = 8

    def __init__(self, shape: Sequence[int] = ()) -> None:
        self._d = tuple(int(d) for d in shape)

    def __len__(self) -> int:
        return len(self._d)

    def __getitem__(self, index: int) -> int:
        if not isinstance(index, int):
            raise TypeError("Dims indices must be integers")
        return self._d[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._d)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Dims):
            return self._d == other._d
        if isinstance(other, (tuple, list)):
            return self._d == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._d)

    def __repr__(self) -> str:
        return repr(self._d)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


class IHostMemory(bytes):
    """Serialized data with the buffer protocol (``bytes(x)``, ``memoryview(x)`` work)."""

    @property
    def nbytes(self) -> int:
        return len(self)

    @property
    def dtype(self) -> DataType:
        return DataType.UINT8


_BINDING_API_ENGINE = {
    "num_bindings",
    "get_binding_index",
    "get_binding_name",
    "binding_is_input",
    "get_binding_shape",
    "get_binding_dtype",
    "get_profile_shape",
    "max_batch_size",
}
_BINDING_API_CONTEXT = {
    "execute_async_v2",
    "execute_async",
    "execute",
    "set_binding_shape",
    "get_binding_shape",
    "all_binding_shapes_specified",
    "set_optimization_profile",
    "active_optimization_profile_index",
}


def _binding_api(obj: object, name: str, removed: set[str]) -> Any:
    """Absent in 10.x; deprecated (and not modelled) before."""
    if name in removed and _version() < (10, 0):

        def deprecated(*args: Any, **kwargs: Any) -> Any:
            warnings.warn(
                f"{name} is deprecated; use the name-based API", DeprecationWarning, stacklevel=2
            )
            raise NotImplementedError(f"fake tensorrt: {name} (binding API) is not modelled")

        return deprecated
    raise AttributeError(
        f"'tensorrt.tensorrt.{type(obj).__name__}' object has no attribute '{name}'"
    )


def _destroyed(gpu: _gpu.FakeGPU, address: int, event: str) -> None:
    """weakref.finalize callback: the pybind object went, its C++ object with it."""
    gpu.release(address)
    gpu.record(event)


# --------------------------------------------------------------------------- the math


_sessions: dict[str, Any] = {}
_sessions_lock = threading.Lock()


def _ort_session(onnx_bytes: bytes) -> Any:
    key = hashlib.sha256(onnx_bytes).hexdigest()
    with _sessions_lock:
        session = _sessions.get(key)
        if session is None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
            _sessions[key] = session
        return session


_ONNX_TO_TRT = {
    1: DataType.FLOAT,
    10: DataType.HALF,
    6: DataType.INT32,
    7: DataType.INT64,
    9: DataType.BOOL,
    2: DataType.UINT8,
    3: DataType.INT8,
}
_ONNX_NP = {
    1: np.float32,
    10: np.float16,
    6: np.int32,
    7: np.int64,
    9: np.bool_,
    2: np.uint8,
    3: np.int8,
}


# --------------------------------------------------------------------------- runtime


class Runtime:
    def __init__(self, logger: ILogger) -> None:
        _adopt_logger(logger, "createInferRuntime")
        self.logger = logger
        self._gpu = _gpu.current()

    def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
        data = bytes(memoryview(serialized_engine))
        where = "runtime.cpp::deserializeCudaEngine::65"
        meta, onnx_bytes = _parse_plan(data)
        if meta is None:
            _error(4, "Internal Error", where, "Engine deserialization failed.")
            return None
        return ICudaEngine(self, meta, onnx_bytes, data)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"'tensorrt.tensorrt.Runtime' object has no attribute '{name}'")


def _parse_plan(data: bytes) -> tuple[dict[str, Any] | None, bytes]:
    reader = "stdArchiveReader.cpp::StdArchiveReader::42"
    if not data.startswith(MAGIC) or len(data) < 12:
        _error(
            1,
            "Serialization",
            reader,
            "Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match",
        )
        return None, b""
    tag, length = struct.unpack("<II", data[4:12])
    current = _serialization_tag(_version())
    if tag != current:
        _error(
            1,
            "Serialization",
            reader,
            "Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed.Version tag "
            "does not match. "
            f"Note: Current Version: {current}, Serialized Engine Version: {tag}",
        )
        return None, b""
    try:
        meta = json.loads(data[12 : 12 + length])
    except ValueError:
        _error(1, "Serialization", reader, "Serialization assertion sizeRead == size failed.")
        return None, b""
    onnx_bytes = data[12 + length :]
    if hashlib.sha256(onnx_bytes).hexdigest() != meta.get("onnx_sha256"):
        _error(1, "Serialization", reader, "Serialization assertion sizeRead == size failed.")
        return None, b""
    gpu = _gpu.current()
    if tuple(meta["compute_capability"]) != gpu.compute_capability:
        have = ".".join(map(str, gpu.compute_capability))
        got = ".".join(map(str, meta["compute_capability"]))
        _error(
            1,
            "Serialization",
            "safeDeserializationUtils.cpp::load::269",
            "Serialization assertion plan file is generated on an incompatible device, expecting "
            f"compute {have} got compute {got}, please rebuild.",
        )
        return None, b""
    return meta, onnx_bytes


class ICudaEngine:
    def __init__(
        self, runtime: Runtime, meta: dict[str, Any], onnx_bytes: bytes, plan: bytes
    ) -> None:
        gpu = _gpu.current()
        self._runtime = runtime  # keep_alive<0, 1>: the engine keeps its runtime
        self._meta = meta
        self._plan = plan
        self._onnx = onnx_bytes
        self._io: list[dict[str, Any]] = meta["io"]
        self._by_name = {t["name"]: t for t in self._io}
        self._profiles: list[dict[str, list[list[int]]]] = meta["profiles"]
        self._contexts: weakref.WeakSet[IExecutionContext] = weakref.WeakSet()
        self._shape_cache: dict[tuple[Any, ...], dict[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self.name = meta.get("name", "engine")
        region = gpu.allocate(len(onnx_bytes) + 64 * 1024, "trt-engine", self.name)
        weakref.finalize(self, _destroyed, gpu, region.address, "trt_engine_destroyed")
        gpu.record("trt_engine_created")

    def __getattr__(self, name: str) -> Any:
        return _binding_api(self, name, _BINDING_API_ENGINE)

    # -- I/O ----------------------------------------------------------------------------

    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    @property
    def num_optimization_profiles(self) -> int:
        return max(1, len(self._profiles))

    @property
    def device_memory_size(self) -> int:
        """The largest activation memory of any profile."""
        return max(self._profile_memory(p) for p in range(self.num_optimization_profiles))

    def _profile_memory(self, profile: int) -> int:
        """Activation memory of `profile` (fake only): grows with its largest inputs."""
        largest = {}
        for t in self._io:
            if t["input"]:
                ranges = self._profiles[profile].get(t["name"]) if self._profiles else None
                largest[t["name"]] = tuple(ranges[2] if ranges is not None else t["shape"])
        return self._shapes_memory(largest)

    def _shapes_memory(self, shapes: dict[str, tuple[int, ...]]) -> int:
        """Activation memory of a run on inputs of these shapes (fake only)."""
        total = 0
        for t in self._io:
            if t["input"]:
                volume = int(np.prod([max(d, 1) for d in shapes[t["name"]]], dtype=np.int64))
                total += volume * np.dtype(_NP[DataType[t["dtype"]]]).itemsize
        return ACTIVATION_BYTES + ACTIVATION_PER_BYTE * total

    @property
    def num_layers(self) -> int:
        return int(self._meta.get("layers", 1))

    @property
    def has_implicit_batch_dimension(self) -> bool:
        return False

    def get_tensor_name(self, index: int) -> str | None:
        return self._io[index]["name"] if 0 <= index < len(self._io) else None

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        tensor = self._by_name.get(name)
        if tensor is None:
            return TensorIOMode.NONE
        return TensorIOMode.INPUT if tensor["input"] else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        tensor = self._by_name.get(name)
        if tensor is None:
            _error(
                3,
                "API Usage Error",
                "engine.cpp::getTensorDataType",
                f"{name} is not a tensor name",
            )
            return DataType.FLOAT
        return DataType[tensor["dtype"]]

    def get_tensor_shape(self, name: str) -> Dims:
        tensor = self._by_name.get(name)
        if tensor is None:
            _error(
                3, "API Usage Error", "engine.cpp::getTensorShape", f"{name} is not a tensor name"
            )
            return Dims(())
        return Dims(tensor["shape"])

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        tensor = self._by_name.get(name)
        if (
            tensor is None
            or not tensor["input"]
            or not 0 <= profile_index < self.num_optimization_profiles
        ):
            _error(
                3,
                "API Usage Error",
                "engine.cpp::getProfileShape",
                f"invalid tensor {name} or profile {profile_index}",
            )
            return [Dims(()), Dims(()), Dims(())]
        shapes = self._profiles[profile_index].get(name) if self._profiles else None
        if shapes is None:
            return [Dims(tensor["shape"])] * 3
        return [Dims(s) for s in shapes]

    def serialize(self) -> IHostMemory:
        return IHostMemory(self._plan)

    def create_execution_context(self, *args: Any, **kwargs: Any) -> IExecutionContext | None:
        """8.x: no arguments; 10.x: ``strategy`` (default ``STATIC``)."""
        strategies = _ExecutionContextAllocationStrategy
        if _version() < (10, 0):
            if args or kwargs:
                raise TypeError("create_execution_context(): incompatible function arguments")
            strategy = strategies.STATIC
        else:
            (strategy,) = args or (kwargs.pop("strategy", strategies.STATIC),)
            if kwargs or not isinstance(strategy, strategies):
                raise TypeError("create_execution_context(): incompatible function arguments")
        return self._new_context(strategy != strategies.USER_MANAGED)

    def create_execution_context_without_device_memory(self) -> IExecutionContext | None:
        if _version() >= (10, 0):
            warnings.warn(
                "create_execution_context_without_device_memory is deprecated, use "
                "create_execution_context instead",
                DeprecationWarning,
                stacklevel=2,
            )
        return self._new_context(False)

    def _new_context(self, with_memory: bool) -> IExecutionContext | None:
        gpu = _gpu.current()
        context = IExecutionContext(self, user_managed=not with_memory)
        if with_memory:
            try:
                region = gpu.allocate(self.device_memory_size, "trt-context", self.name)
            except _gpu.Error:
                _error(1, "Cuda Runtime", "executionContext.cpp::ExecutionContext", "out of memory")
                return None
            weakref.finalize(context, _destroyed, gpu, region.address, "trt_context_destroyed")
        gpu.record("trt_context_created", user_managed=not with_memory)
        with self._lock:
            self._contexts.add(context)
        return context

    # -- the math (fake only) -----------------------------------------------------------

    def _profile_users(self, profile: int, but: IExecutionContext) -> bool:
        with self._lock:
            return any(c is not but and c._profile == profile for c in list(self._contexts))

    def _onnx_inputs(
        self, arrays: dict[str, np.ndarray[Any, Any]]
    ) -> dict[str, np.ndarray[Any, Any]]:
        return {
            t["name"]: arrays[t["name"]].astype(_ONNX_NP[t["onnx_type"]], copy=False)
            for t in self._io
            if t["input"]
        }

    def _compute(self, arrays: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        session = _ort_session(self._onnx)
        names = [t["name"] for t in self._io if not t["input"]]
        values = session.run(names, self._onnx_inputs(arrays))
        result = {}
        for name, value in zip(names, values, strict=True):
            dtype = _NP[DataType[self._by_name[name]["dtype"]]]
            if self._meta.get("fp16") and np.issubdtype(value.dtype, np.floating):
                value = value.astype(np.float16).astype(value.dtype)
            result[name] = np.ascontiguousarray(value.astype(dtype, copy=False))
        return result

    def _output_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        key = tuple(sorted(shapes.items()))
        with self._lock:
            cached = self._shape_cache.get(key)
        if cached is None:
            zeros = {
                t["name"]: np.zeros(shapes[t["name"]], dtype=_NP[DataType[t["dtype"]]])
                for t in self._io
                if t["input"]
            }
            cached = {name: a.shape for name, a in self._compute(zeros).items()}
            with self._lock:
                self._shape_cache[key] = cached
        return cached


class IExecutionContext:
    def __init__(self, engine: ICudaEngine, *, user_managed: bool = False) -> None:
        self._engine = engine  # keep_alive<0, 1>: the context keeps its engine
        self.name = ""
        self._user_managed = user_managed  # its activation memory is the application's
        self._memory: tuple[int, int | None] | None = None  # (address, size if given)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        # 9.0+: every new context starts on profile 0. Before: profile 0 only if no other
        # context has it (NvInferRuntime.h 8.6), otherwise none until set explicitly.
        if _version() >= (9, 0) or not engine._profile_users(0, self):
            self._profile: int | None = 0
        else:
            self._profile = None

    def __getattr__(self, name: str) -> Any:
        if name == "update_device_memory_size_for_shapes" and _version() >= (10, 0):
            return self._update_device_memory_size_for_shapes
        if name == "set_device_memory" and _version() >= (10, 1):
            return self._set_device_memory
        return _binding_api(self, name, _BINDING_API_CONTEXT)

    @property
    def engine(self) -> ICudaEngine:
        return self._engine

    # -- activation memory --------------------------------------------------------------

    def _set_memory(self, memory: int) -> None:
        self._memory = (int(memory), None)
        _gpu.current().record("device_memory_set", size=None)

    device_memory = property(None, _set_memory)  # pybind def_property(nullptr, setter)

    def _set_device_memory(self, memory: int, size: int) -> None:
        self._memory = (int(memory), int(size))
        _gpu.current().record("device_memory_set", size=int(size))

    def _update_device_memory_size_for_shapes(self) -> int:
        if self._profile is None or self._unspecified():
            _error(
                3,
                "API Usage Error",
                "executionContext.cpp::updateDeviceMemorySizeForShapes",
                "all input shapes and the optimization profile must be set first",
            )
            return 0
        return self._needed()

    def _needed(self) -> int:
        """Activation memory this run needs: its profile's, or (an engine built with
        RUNTIME_ACTIVATION_RESIZE_10_10) its input shapes'."""
        assert self._profile is not None
        if not self._engine._meta.get("activation_resize"):
            return self._engine._profile_memory(self._profile)
        return self._engine._shapes_memory(self._input_shapes())

    def _activation_memory(self, where: str) -> tuple[int, int] | None:
        """(address, bytes) of the memory a run may use; None (logged) when it has none."""
        assert self._profile is not None
        needed = self._needed()
        if self._memory is None:
            _error(
                3,
                "API Usage Error",
                where,
                "Parameter check failed, condition: mDeviceMemory != nullptr. The execution "
                "context was created without device memory: set it before enqueue",
            )
            return None
        address, size = self._memory
        if size is not None and size < needed:
            _error(3, "API Usage Error", where, f"device memory of {size} bytes < {needed} needed")
            return None
        return address, needed

    @property
    def active_optimization_profile(self) -> int:
        return -1 if self._profile is None else self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        engine = self._engine
        count = engine.num_optimization_profiles
        where = "executionContext.cpp::setOptimizationProfileInternal::1328"
        if not 0 <= profile_index < count:
            _error(
                3,
                "API Usage Error",
                where,
                "Parameter check failed, condition: profileIndex >= 0 && profileIndex < "
                f"mEngine.getNbOptimizationProfiles(). profile index {profile_index} out of range "
                f"[0, {count})",
            )
            raise RuntimeError("Error in set optimization profile async.")
        if _version() < (8, 6) and engine._profile_users(profile_index, self):
            _error(
                3,
                "API Usage Error",
                where,
                f"Profile {profile_index} has been chosen by another IExecutionContext. Use "
                "another profileIndex or destroy the IExecutionContext that use this profile.",
            )
            raise RuntimeError("Error in set optimization profile async.")
        self._profile = profile_index
        self._shapes = {}  # switching invalidates the input shapes set so far
        return True

    def _range(self, name: str) -> list[list[int]] | None:
        profiles = self._engine._profiles
        if not profiles or self._profile is None:
            return None
        return profiles[self._profile].get(name)

    def set_input_shape(self, name: str, shape: Any) -> bool:
        where = "executionContext.cpp::setInputShape::2068"
        tensor = self._engine._by_name.get(name)
        if tensor is None or not tensor["input"]:
            _error(
                3,
                "API Usage Error",
                where,
                f"Parameter check failed, condition: mEngine.bindingIsInput(bindingIndex). {name} "
                "is not an input tensor",
            )
            return False
        if self._profile is None:
            _error(
                3, "API Usage Error", where, "no optimization profile has been set for this context"
            )
            return False
        dims = _shape(shape)
        engine_dims = tensor["shape"]
        if len(dims) != len(engine_dims):
            _error(
                3,
                "API Usage Error",
                where,
                "Parameter check failed, condition: engineDims.nbDims == dimensions.nbDims. "
                f"{name}: rank {len(dims)} given, the engine has {len(engine_dims)}",
            )
            return False
        ranges = self._range(name)
        for i, d in enumerate(dims):
            if engine_dims[i] >= 0 and d != engine_dims[i]:
                _error(
                    3,
                    "API Usage Error",
                    where,
                    "Parameter check failed, condition: engineDims.d[i] == dims.d[i]. Static "
                    f"dimension mismatch while setting input shape for {name}. Set dimensions are "
                    f"{list(dims)}. Expected dimensions are {list(engine_dims)}.",
                )
                return False
            if ranges is not None and not ranges[0][i] <= d <= ranges[2][i]:
                _error(
                    3,
                    "API Usage Error",
                    where,
                    "Parameter check failed, condition: profileMinDims.d[i] <= dimensions.d[i] "
                    "&& dimensions.d[i] <= profileMaxDims.d[i]. Supplied binding dimension "
                    f"{list(dims)} for bindings[{name}] exceed min ~ max range at index {i}, "
                    f"maximum dimension in profile is {ranges[2][i]}, minimum dimension in "
                    f"profile is {ranges[0][i]}, but supplied dimension is {d}.",
                )
                return False
        self._shapes[name] = dims
        return True

    def _unspecified(self) -> list[str]:
        return [
            t["name"]
            for t in self._engine._io
            if t["input"] and any(d < 0 for d in t["shape"]) and t["name"] not in self._shapes
        ]

    def _input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            t["name"]: self._shapes.get(t["name"], tuple(t["shape"]))
            for t in self._engine._io
            if t["input"]
        }

    def get_tensor_shape(self, name: str) -> Dims:
        tensor = self._engine._by_name.get(name)
        if tensor is None:
            _error(
                3,
                "API Usage Error",
                "executionContext.cpp::getTensorShape",
                f"{name} is not a tensor name",
            )
            return Dims(())
        if tensor["input"]:
            return Dims(self._shapes.get(name, tensor["shape"]))
        if self._unspecified():
            return Dims(tensor["shape"])
        return Dims(self._engine._output_shapes(self._input_shapes())[name])

    def infer_shapes(self) -> list[str]:
        missing = self._unspecified()
        if missing:
            return missing
        try:
            self._engine._output_shapes(self._input_shapes())
        except Exception:
            raise RuntimeError("infer_shapes error code: -1") from None
        return []

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if name not in self._engine._by_name:
            _error(
                3,
                "API Usage Error",
                "executionContext.cpp::setTensorAddress",
                f"Parameter check failed, condition: mEngine.isTensorName(name). {name} is not "
                "the name of an input or output tensor",
            )
            return False
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def execute_async_v3(self, stream_handle: int) -> bool:
        engine = self._engine
        gpu = _gpu.current()
        where = "executionContext.cpp::enqueueV3::2666"
        if self._profile is None:
            _error(
                3, "API Usage Error", where, "no optimization profile has been set for this context"
            )
            return False
        missing = self._unspecified()
        if missing:
            _error(
                3,
                "API Usage Error",
                where,
                "Parameter check failed, condition: mContext.allInputDimensionsSpecified(). "
                f"input shape not specified for {', '.join(missing)}",
            )
            return False
        for t in engine._io:
            if t["name"] not in self._addresses:
                kind = "input" if t["input"] else "output"
                _error(
                    3,
                    "API Usage Error",
                    where,
                    f"Address is not set for {kind} tensor {t['name']}. Call "
                    "setInputTensorAddress or setTensorAddress before enqueue/execute.",
                )
                return False
        shapes = self._input_shapes()
        shapes.update(engine._output_shapes(shapes))
        plan = []
        for t in engine._io:
            dtype = np.dtype(_NP[DataType[t["dtype"]]])
            shape = shapes[t["name"]]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            address = self._addresses[t["name"]]
            try:
                gpu.view(address, nbytes)
            except _gpu.Error:
                _error(
                    1,
                    "Cuda Runtime",
                    "checkMacros.cpp::catchCudaError",
                    f"an illegal memory access was encountered (tensor {t['name']})",
                )
                return False
            plan.append((t["name"], t["input"], dtype, shape, nbytes, address))
        scratch = self._activation_memory(where) if self._user_managed else None
        if self._user_managed:
            if scratch is None:
                return False
            try:
                gpu.view(*scratch)
            except _gpu.Error:
                _error(
                    1,
                    "Cuda Runtime",
                    "checkMacros.cpp::catchCudaError",
                    "an illegal memory access was encountered (activation memory)",
                )
                return False

        def run() -> None:
            arrays = {
                name: gpu.view(address, nbytes).view(dtype).reshape(shape).copy()
                for name, is_input, dtype, shape, nbytes, address in plan
                if is_input
            }
            if scratch is not None:  # the activations are written while the inputs are read
                gpu.view(*scratch)[...] = 0xA5
            outputs = engine._compute(arrays)
            for name, is_input, _, _, nbytes, address in plan:
                if not is_input:
                    gpu.view(address, nbytes)[...] = outputs[name].reshape(-1).view(np.uint8)

        if stream_handle == 0:
            _log(
                ILogger.WARNING,
                "Using default stream in enqueueV3() may lead to performance issues due to "
                "additional calls to cudaStreamSynchronize() by TensorRT to ensure correct "
                "synchronization. Please use non-default stream instead.",
            )
            run()
        else:
            stream = gpu.stream(int(stream_handle))
            if stream is None:
                _error(1, "Cuda Runtime", where, "invalid resource handle")
                return False
            stream.enqueue(run)
        gpu.record("enqueue", profile=self._profile)
        return True


# --------------------------------------------------------------------------- builder


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class BuilderFlag(enum.IntEnum):
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 5
    DISABLE_TIMING_CACHE = 6
    TF32 = 7
    SPARSE_WEIGHTS = 8
    OBEY_PRECISION_CONSTRAINTS = 10
    FP8 = 12


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4


class ErrorCode(enum.IntEnum):
    SUCCESS = 0
    INTERNAL_ERROR = 1
    MEM_ALLOC_FAILED = 2
    MODEL_DESERIALIZE_FAILED = 3
    INVALID_VALUE = 4
    INVALID_GRAPH = 5
    INVALID_NODE = 6
    UNSUPPORTED_GRAPH = 7
    UNSUPPORTED_NODE = 8


class ParserError:
    def __init__(
        self, code: ErrorCode, desc: str, node: int = -1, node_name: str = "", op: str = ""
    ) -> None:
        self._code, self._desc, self._node, self._name, self._op = code, desc, node, node_name, op

    def code(self) -> ErrorCode:
        return self._code

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op

    def file(self) -> str:
        return "ModelImporter.cpp"

    def line(self) -> int:
        return 0

    def func(self) -> str:
        return "parseGraph"

    def __str__(self) -> str:
        return (
            f"In node {self._node} with name: {self._name} and operator: {self._op} "
            f"(parseGraph): {self._code.name}: {self._desc}"
        )


class ITensor:
    def __init__(
        self, name: str, shape: Sequence[int], dtype: DataType, onnx_type: int, is_input: bool
    ) -> None:
        self.name = name
        self.shape = Dims(shape)
        self.dtype = dtype
        self.onnx_type = onnx_type
        self.is_network_input = is_input
        self.is_network_output = not is_input
        self.is_shape_tensor = False


class INetworkDefinition:
    def __init__(self, flags: int) -> None:
        self._explicit = _version() >= (10, 0) or bool(
            flags & (1 << NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        )
        self._inputs: list[ITensor] = []
        self._outputs: list[ITensor] = []
        self._onnx = b""
        self._nodes: list[tuple[str, str]] = []

    @property
    def has_implicit_batch_dimension(self) -> bool:
        return not self._explicit

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    @property
    def num_layers(self) -> int:
        return len(self._nodes)

    def get_input(self, index: int) -> ITensor:
        return self._inputs[index]

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger) -> None:
        _adopt_logger(logger, "OnnxParser")
        self._network = network
        self._errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError:
        return self._errors[index]

    def clear_errors(self) -> None:
        self._errors = []

    def parse_from_file(self, model: str) -> bool:
        try:
            with open(model, "rb") as f:
                data = f.read()
        except OSError:
            self._errors.append(
                ParserError(ErrorCode.MODEL_DESERIALIZE_FAILED, f"Failed to open file: {model}")
            )
            return False
        return self.parse(data, model)

    def parse(self, model: bytes, path: str | None = None) -> bool:
        import onnx

        if not self._network._explicit:
            self._errors.append(
                ParserError(
                    ErrorCode.INVALID_VALUE,
                    "The ONNX parser only supports networks with an explicit batch dimension",
                )
            )
            return False
        try:
            proto = onnx.load_from_string(bytes(model))
            onnx.checker.check_model(proto)
            _ort_session(bytes(model))
        except Exception as exc:
            self._errors.append(
                ParserError(
                    ErrorCode.MODEL_DESERIALIZE_FAILED,
                    f"Failed to parse ONNX model: {' '.join(str(exc).split())[:200]}",
                )
            )
            return False
        weights = {i.name for i in proto.graph.initializer}
        cast_int64 = _version() < (10, 0)
        for value, is_input in [(v, True) for v in proto.graph.input if v.name not in weights] + [
            (v, False) for v in proto.graph.output
        ]:
            elem = value.type.tensor_type.elem_type
            dtype = _ONNX_TO_TRT.get(elem)
            if dtype is None:
                self._errors.append(
                    ParserError(
                        ErrorCode.UNSUPPORTED_GRAPH,
                        f"tensor {value.name}: unsupported data type {elem}",
                    )
                )
                return False
            if dtype == DataType.INT64 and cast_int64:
                _log(
                    ILogger.WARNING,
                    "Your ONNX model has been generated with INT64 weights, while TensorRT does "
                    "not natively support INT64. Attempting to cast down to INT32.",
                )
                dtype = DataType.INT32
            dims = [
                d.dim_value if d.HasField("dim_value") else -1
                for d in value.type.tensor_type.shape.dim
            ]
            tensor = ITensor(value.name, dims, dtype, elem, is_input)
            (self._network._inputs if is_input else self._network._outputs).append(tensor)
        self._network._onnx = bytes(model)
        self._network._nodes = [(n.op_type, n.name) for n in proto.graph.node]
        return True


class IOptimizationProfile:
    def __init__(self) -> None:
        self._shapes: dict[str, list[tuple[int, ...]]] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
        lo, mid, hi = _shape(min), _shape(opt), _shape(max)
        if not len(lo) == len(mid) == len(hi):
            raise RuntimeError("Shape provided for opt is inconsistent with other shapes.")
        for a, b, c in zip(lo, mid, hi, strict=True):
            if a < 0 or a > b:
                raise RuntimeError("Shape provided for opt is inconsistent with other shapes.")
            if b > c:
                raise RuntimeError("Shape provided for max is inconsistent with other shapes.")
        self._shapes[input] = [lo, mid, hi]

    def get_shape(self, input: str) -> list[Dims]:
        return [Dims(s) for s in self._shapes.get(input, [])]

    def __bool__(self) -> bool:
        return True


class ITimingCache:
    def __init__(self, entries: set[str], version: str, cc: tuple[int, int]) -> None:
        self._entries = set(entries)
        self._version = version
        self._cc = cc

    def serialize(self) -> IHostMemory:
        body = json.dumps(
            {"trt": self._version, "cc": list(self._cc), "entries": sorted(self._entries)}
        ).encode()
        return IHostMemory(TIMING_MAGIC + body)

    def combine(self, input_cache: ITimingCache, ignore_mismatch: bool) -> bool:
        if not ignore_mismatch and (input_cache._version, input_cache._cc) != (
            self._version,
            self._cc,
        ):
            return False
        self._entries |= input_cache._entries
        return True

    def reset(self) -> bool:
        self._entries.clear()
        return True


class IProgressMonitor:
    """TensorRT 10+: subclasses must call ``trt.IProgressMonitor.__init__(self)``."""

    def __init__(self) -> None:
        self._trt_initialised = True

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        raise NotImplementedError

    def step_complete(self, phase_name: str, step: int) -> bool:
        raise NotImplementedError

    def phase_finish(self, phase_name: str) -> None:
        raise NotImplementedError


class _NoMonitor:
    """The fake's stand-in where no progress monitor is set (no such class in TensorRT): hears
    the phases, never cancels."""

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        pass

    def step_complete(self, phase_name: str, step: int) -> bool:
        return True

    def phase_finish(self, phase_name: str) -> None:
        pass


class IBuilderConfig:
    def __init__(self) -> None:
        self._flags: set[BuilderFlag] = set()
        self._pools: dict[MemoryPoolType, int] = {}
        self._profiles: list[IOptimizationProfile] = []
        self._timing_cache: ITimingCache | None = None
        self._monitor: Any = None
        self.int8_calibrator: Any = None
        self.builder_optimization_level = 3
        self._preview: set[int] = set()

    def set_preview_feature(self, feature: Any, enable: bool) -> None:
        (self._preview.add if enable else self._preview.discard)(int(feature))

    def get_preview_feature(self, feature: Any) -> bool:
        return int(feature) in self._preview

    def set_flag(self, flag: BuilderFlag) -> None:
        self._flags.add(flag)

    def clear_flag(self, flag: BuilderFlag) -> None:
        self._flags.discard(flag)

    def get_flag(self, flag: BuilderFlag) -> bool:
        return flag in self._flags

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self._pools[pool] = int(pool_size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self._pools.get(pool, _gpu.current().total_memory)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        if not profile._shapes:
            _error(
                4,
                "API Usage Error",
                "builderConfig.cpp::addOptimizationProfile",
                "Optimization profile is invalid: no shapes set",
            )
            return -1
        self._profiles.append(profile)
        return len(self._profiles) - 1

    def create_timing_cache(self, serialized_timing_cache: Any) -> ITimingCache | None:
        data = bytes(memoryview(serialized_timing_cache))
        gpu = _gpu.current()
        if not data:
            return ITimingCache(set(), gpu.trt_version, gpu.compute_capability)
        if not data.startswith(TIMING_MAGIC):
            _error(
                1,
                "Serialization",
                "timingCache.cpp::load",
                "Serialization assertion magicTagRead == kMAGIC_TAG failed.",
            )
            return None
        try:
            body = json.loads(data[len(TIMING_MAGIC) :])
        except ValueError:
            _error(
                1,
                "Serialization",
                "timingCache.cpp::load",
                "Serialization assertion sizeRead == size failed.",
            )
            return None
        return ITimingCache(set(body["entries"]), body["trt"], tuple(body["cc"]))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        gpu = _gpu.current()
        if not ignore_mismatch and (cache._version, cache._cc) != (
            gpu.trt_version,
            gpu.compute_capability,
        ):
            _error(
                4,
                "API Usage Error",
                "builderConfig.cpp::setTimingCache",
                "Cannot set a timing cache that was built on another device or TensorRT version "
                "without ignore_mismatch",
            )
            return False
        self._timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing_cache

    @property
    def progress_monitor(self) -> Any:
        if _version() < (10, 0):
            raise AttributeError(
                "'tensorrt.tensorrt.IBuilderConfig' object has no attribute 'progress_monitor'"
            )
        return self._monitor

    @progress_monitor.setter
    def progress_monitor(self, monitor: Any) -> None:
        if _version() < (10, 0):
            raise AttributeError(
                "'tensorrt.tensorrt.IBuilderConfig' object has no attribute 'progress_monitor'"
            )
        if not getattr(monitor, "_trt_initialised", False):
            raise TypeError(
                f"{type(monitor).__name__}.__init__() must be called when overriding __init__"
            )
        self._monitor = monitor


class Builder:
    def __init__(self, logger: ILogger) -> None:
        _adopt_logger(logger, "createInferBuilder")
        self.logger = logger

    def __getattr__(self, name: str) -> Any:
        if name in {"build_engine", "max_batch_size", "build_cuda_engine"} and _version() < (10, 0):
            return _binding_api(self, name, {name})
        raise AttributeError(f"'tensorrt.tensorrt.Builder' object has no attribute '{name}'")

    @property
    def platform_has_fast_fp16(self) -> bool:
        return True

    @property
    def platform_has_fast_int8(self) -> bool:
        return True

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(
        self, network: INetworkDefinition, config: IBuilderConfig
    ) -> IHostMemory | None:
        gpu = _gpu.current()
        where = "builder.cpp::buildSerializedNetwork::751"
        if not network._inputs:
            _error(
                4, "Internal Error", where, "Network must have at least one input and one output"
            )
            return None
        dynamic = [t for t in network._inputs if any(d < 0 for d in t.shape)]
        if dynamic and not config._profiles:
            _error(
                4,
                "Internal Error",
                where,
                "Network has dynamic or shape inputs, but no optimization profile has been "
                "defined.",
            )
            return None
        profiles = []
        for index, profile in enumerate(config._profiles):
            chosen: dict[str, list[list[int]]] = {}
            for t in network._inputs:
                shapes = profile._shapes.get(t.name)
                if shapes is None:
                    if t in dynamic:
                        _error(
                            4,
                            "Internal Error",
                            where,
                            f"{t.name}: dynamic input is missing dimensions in profile {index}.",
                        )
                        return None
                    continue
                dims = list(t.shape)
                if len(shapes[0]) != len(dims) or any(
                    d >= 0 and not s[0][i] == s[1][i] == s[2][i] == d
                    for s in [shapes]
                    for i, d in enumerate(dims)
                ):
                    _error(
                        4,
                        "API Usage Error",
                        where,
                        f"{t.name}: profile {index} does not match network definition {dims}",
                    )
                    return None
                chosen[t.name] = [list(s) for s in shapes]
            profiles.append(chosen)
        workspace = config._pools.get(MemoryPoolType.WORKSPACE)
        if workspace is not None and workspace < 4096:
            _log(
                ILogger.WARNING,
                f"Tactic Device request: workspace {workspace} bytes is too small; skipping "
                "tactics",
            )
            _error(
                10,
                "Internal Error",
                "optimizer.cpp::computeCosts",
                "Could not find any implementation for node "
                f"{network._nodes[0][1] if network._nodes else '?'}.",
            )
            return None
        if not self._monitor_phases(config, network):
            _error(4, "Internal Error", where, "Build was cancelled by the progress monitor")
            return None
        self._use_timing_cache(config, network)
        gpu.builds += 1
        fp16 = config.get_flag(BuilderFlag.FP16)
        io = [
            {
                "name": t.name,
                "input": t.is_network_input,
                "dtype": t.dtype.name,
                "shape": list(t.shape),
                "onnx_type": t.onnx_type,
            }
            for t in network._inputs + network._outputs
        ]
        meta = {
            "trt": gpu.trt_version,
            "device": gpu.name,
            "compute_capability": list(gpu.compute_capability),
            "io": io,
            "profiles": profiles,
            "fp16": fp16,
            "int8": config.get_flag(BuilderFlag.INT8),
            "activation_resize": _RUNTIME_ACTIVATION_RESIZE in config._preview,
            "layers": len(network._nodes),
            "onnx_sha256": hashlib.sha256(network._onnx).hexdigest(),
        }
        return IHostMemory(make_plan(meta, network._onnx))

    @staticmethod
    def _monitor_phases(config: IBuilderConfig, network: INetworkDefinition) -> bool:
        """The phases a build reports: "Building engine" (2 steps) holding "Tactic
        selection" (a step per layer). ``FakeGPU.build_hook`` runs before each step ends,
        also before 10.0 (no monitor), so a test can hold a build in any TensorRT."""
        monitor = _NoMonitor() if config._monitor is None else config._monitor
        hook = _gpu.current().build_hook or (lambda phase, step: None)
        layers = max(1, len(network._nodes))
        monitor.phase_start("Building engine", None, 2)
        monitor.phase_start("Tactic selection", "Building engine", layers)
        for step in range(layers):
            hook("Tactic selection", step)
            if not monitor.step_complete("Tactic selection", step):
                monitor.phase_finish("Tactic selection")
                monitor.phase_finish("Building engine")
                return False
        hook("Building engine", 0)
        monitor.phase_finish("Tactic selection")
        if not monitor.step_complete("Building engine", 0):
            monitor.phase_finish("Building engine")
            return False
        hook("Building engine", 1)
        monitor.step_complete("Building engine", 1)
        monitor.phase_finish("Building engine")
        return True

    @staticmethod
    def _use_timing_cache(config: IBuilderConfig, network: INetworkDefinition) -> None:
        cache = config._timing_cache
        gpu = _gpu.current()
        fp16 = config.get_flag(BuilderFlag.FP16)
        for op, name in network._nodes:
            key = f"{op}:{name}:{fp16}"
            if cache is not None and key in cache._entries:
                gpu.timing_cache_hits += 1
            else:
                gpu.timing_cache_misses += 1
                if cache is not None:
                    cache._entries.add(key)


def make_plan(meta: dict[str, Any], onnx_bytes: bytes, tag: int | None = None) -> bytes:
    """The fake plan format: magic, serialization tag, JSON header length, header, ONNX."""
    header = json.dumps({**meta, "onnx_sha256": hashlib.sha256(onnx_bytes).hexdigest()}).encode()
    version = _serialization_tag(_version()) if tag is None else tag
    return MAGIC + struct.pack("<II", version, len(header)) + header + onnx_bytes


def __getattr__(name: str) -> Any:
    """Module attributes that exist only in some versions (PEP 562)."""
    if name == "IProgressMonitor" and _version() >= (10, 0):
        return _IProgressMonitor
    if name == "ExecutionContextAllocationStrategy" and _version() >= (10, 0):
        return _ExecutionContextAllocationStrategy
    if name == "PreviewFeature":
        return _PreviewFeature_10_10 if _version() >= (10, 10) else _PreviewFeature
    raise AttributeError(f"module 'tensorrt' has no attribute '{name}'")


_IProgressMonitor = IProgressMonitor
del IProgressMonitor  # reachable only through the version-aware module __getattr__
_ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy
del ExecutionContextAllocationStrategy
