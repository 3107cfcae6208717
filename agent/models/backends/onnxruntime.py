"""The ONNX Runtime backend: execution providers picked from config, with a logged fallback.

``onnxruntime`` is imported inside :meth:`OnnxRuntimeBackend.load`, so the agent (and a
TensorRT-only install) imports without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.backends import base
from agent.models.backends.base import (
    ONNX_ELEMENT_DTYPES,
    BackendOptions,
    Dim,
    InferenceError,
    ModelLoadError,
    TensorSpec,
    one_line,
)
from agent.models.backends.external_data import external_data_problem
from agent.models.backends.ort_cut import DeviceCutter
from agent.models.backends.ort_steps import OrtStepBinding, bindable
from agent.models.onnx_header import model_metadata

__all__ = [
    "CPU_PROVIDER",
    "ORT_DTYPES",
    "OnnxRuntimeBackend",
    "OnnxSession",
    "gpu_provider_options",
    "select_providers",
]

log = logging.getLogger(__name__)

# One run in this long gives the CPU memory arena's free chunks back to the system at its end
# (ONNX Runtime's `memory.enable_memory_arena_shrinkage`, decision 0039): what one large
# request grew the arena to goes within this long of the traffic that follows it.
SHRINK_EVERY_S = 30.0
SHRINK_KEY = "memory.enable_memory_arena_shrinkage"

CPU_PROVIDER = "CPUExecutionProvider"

# ONNX Runtime's type strings for the tensor types the wire format can carry.
ORT_DTYPES: dict[str, np.dtype[Any]] = {
    f"tensor({name})": dtype for name, dtype in ONNX_ELEMENT_DTYPES.items()
}
_OBJECT = np.dtype(object)


def _shrink_options(arenas: str = "cpu:0") -> Any:
    """Run options asking ONNX Runtime to free the unused chunks of `arenas` (its format:
    "cpu:0", "cpu:0;gpu:1") at the end of the run; None where this onnxruntime cannot make
    them."""
    try:
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry(SHRINK_KEY, arenas)
    except Exception:  # an onnxruntime without RunOptions config entries
        return None
    return options


def select_providers(requested: Sequence[str], available: Sequence[str]) -> list[str]:
    """Keep the requested providers this build has, in order, with CPU always last.

    Each requested provider that is missing gets one warning line, so a Jetson that lost its
    TensorRT libraries says so instead of silently running on the CPU.
    """
    chosen: list[str] = []
    for name in requested:
        if name == CPU_PROVIDER or name in chosen:
            continue
        if name in available:
            chosen.append(name)
        else:
            log.warning(
                "execution provider %s is not available (available: %s); falling back",
                name,
                ", ".join(available) or "none",
            )
    chosen.append(CPU_PROVIDER)
    return chosen


def _spec(node_arg: Any) -> TensorSpec:
    """One ORT NodeArg as a TensorSpec. Every type loads: strings, sequences, maps and
    tensors numpy lacks (bfloat16, float8) get the object dtype and their ONNX type, so a
    classifier serves its numeric outputs and only a request touching the others fails."""
    onnx_type = str(node_arg.type) or "unknown"
    dtype = ORT_DTYPES.get(onnx_type, _OBJECT)
    shape: tuple[Dim, ...] = ()
    if onnx_type.startswith("tensor("):  # sequences and maps have no shape of their own
        shape = tuple(_dim(d) for d in (node_arg.shape or ()))
    return TensorSpec(name=node_arg.name, dtype=dtype, shape=shape, type=onnx_type)


def _dim(d: object) -> Dim:
    if isinstance(d, int) and not isinstance(d, bool):
        return d if d >= 0 else None
    if isinstance(d, str) and d:
        return d
    return None


GPU_OPTION_KEYS = ("device_id", "engine_cache_path", "fp16", "timing_cache", "workspace_bytes")
TENSORRT_PROVIDER = "TensorrtExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"


def _flag(value: bool) -> str:
    return "True" if value else "False"


def gpu_provider_options(extra: Mapping[str, object]) -> dict[str, dict[str, str]]:
    """TensorRT / CUDA execution provider options from ``options.extra["gpu"]``.

    The few settings that matter on a Jetson, under agent names, so a config does not need
    ONNX Runtime's spelling: ``engine_cache_path`` (TensorRT EP engine cache: without it the
    EP rebuilds its engines, minutes on a Jetson, at every start), ``timing_cache`` (bool,
    kept beside the engines), ``fp16`` (bool), ``workspace_bytes`` (int), ``device_id``
    (int, both providers). Validated at once, so a typo fails the load instead of being
    ignored.
    """
    raw = extra.get("gpu", {})
    if not isinstance(raw, Mapping):
        raise ModelLoadError("backend option 'gpu' must be a table")
    unknown = sorted(str(k) for k in raw if k not in GPU_OPTION_KEYS)
    if unknown:
        raise ModelLoadError(
            f"unknown gpu option(s) {', '.join(unknown)} (known: {', '.join(GPU_OPTION_KEYS)})"
        )
    trt: dict[str, str] = {}
    cuda: dict[str, str] = {}
    if "device_id" in raw:
        trt["device_id"] = cuda["device_id"] = str(_non_negative(raw["device_id"], "device_id"))
    cache = raw.get("engine_cache_path")
    if cache is not None:
        if not isinstance(cache, str | Path) or not str(cache):
            raise ModelLoadError("gpu.engine_cache_path must be a folder path")
        trt["trt_engine_cache_enable"] = "True"
        trt["trt_engine_cache_path"] = str(cache)
    timing = raw.get("timing_cache", False)
    if not isinstance(timing, bool):
        raise ModelLoadError(f"gpu.timing_cache must be true or false, got {timing!r}")
    if timing:
        if cache is None:
            raise ModelLoadError("gpu.timing_cache needs gpu.engine_cache_path (it is kept there)")
        trt["trt_timing_cache_enable"] = "True"
        trt["trt_timing_cache_path"] = str(cache)
    if "fp16" in raw:
        if not isinstance(raw["fp16"], bool):
            raise ModelLoadError(f"gpu.fp16 must be true or false, got {raw['fp16']!r}")
        trt["trt_fp16_enable"] = _flag(raw["fp16"])
    if "workspace_bytes" in raw:
        trt["trt_max_workspace_size"] = str(
            _non_negative(raw["workspace_bytes"], "workspace_bytes")
        )
    return {TENSORRT_PROVIDER: trt, CUDA_PROVIDER: cuda}


def _device_of(session: Any, providers: Sequence[str]) -> tuple[str, int]:
    """("cuda", its device id) where the session's first provider is a GPU one."""
    if not providers or providers[0] not in (CUDA_PROVIDER, TENSORRT_PROVIDER):
        return ("cpu", 0)
    get_options = getattr(session, "get_provider_options", None)
    options = get_options().get(providers[0], {}) if get_options is not None else {}
    try:
        return ("cuda", int(options.get("device_id", 0) or 0))
    except (TypeError, ValueError):
        return ("cuda", 0)


def _non_negative(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"gpu.{key} must be an integer >= 0, got {value!r}")
    return value


def _provider_options(names: Sequence[str], extra: Mapping[str, object]) -> list[dict[str, str]]:
    """Per-provider options: ``extra["gpu"]`` defaults, then ``extra["provider_options"]``
    ({provider: {k: v}}, ONNX Runtime's own keys), which win key by key."""
    defaults = gpu_provider_options(extra)
    raw = extra.get("provider_options", {})
    if not isinstance(raw, Mapping):
        raise ModelLoadError("provider_options must map a provider name to a table of options")
    result: list[dict[str, str]] = []
    for name in names:
        opts = raw.get(name, {})
        if not isinstance(opts, Mapping):
            raise ModelLoadError(f"provider_options for {name} must be a table")
        result.append({**defaults.get(name, {}), **{str(k): str(v) for k, v in opts.items()}})
    return result


class OnnxSession:
    """A loaded ONNX model. ``run`` may be called from several threads at once."""

    def __init__(
        self, session: Any, model_file: Path, metadata: Mapping[str, Any] | None = None
    ) -> None:
        self._session: Any = session
        self.model_file = model_file
        self._metadata = dict(metadata) if metadata is not None else None
        self._inputs = tuple(_spec(a) for a in session.get_inputs())
        self._outputs = tuple(_spec(a) for a in session.get_outputs())
        # A tensor numpy has no type for (bfloat16, float8) cannot be handed to Python, and
        # asking for one fails the whole run: such outputs are never fetched. A run returns
        # the others; a request asking for one is told which (`modes._chosen`).
        self._output_names = tuple(s.name for s in self._outputs if s.has_numpy_form)
        # Named, not None: ORT's wrapper then skips listing them on every run (0.6 µs of a
        # 12 µs run of a tiny decoder step, docs/decisions/0029).
        self._output_list = list(self._output_names)
        self._providers = tuple(str(p) for p in session.get_providers())
        self._device = _device_of(session, self._providers)
        # The arenas a run shrinks: the CPU's, and a GPU session's device arena too (None:
        # this session's runs never shrink); the CPU's alone where ONNX Runtime refuses that.
        self._shrink_cpu: Any = _shrink_options()
        kind, device_id = self._device
        gpu = _shrink_options(f"cpu:0;gpu:{device_id}") if kind == "cuda" else None
        self._shrink: Any = gpu if gpu is not None else self._shrink_cpu
        self._next_shrink = time.monotonic() + SHRINK_EVERY_S
        # Idle: the inputs of a run that shrinks the arena once no run came for a while
        # (`release_idle`): the warm-up's, else (none, or over `IDLE_INPUTS_MAX_BYTES`) the
        # first small request's (`_seek_idle` until some are kept, and no more once a
        # shrinking run of them failed); when the last run began, and whether it shrank.
        self._idle_inputs: dict[str, npt.NDArray[Any]] | None = None
        self._seek_idle = self._shrink is not None
        self._last_run = time.monotonic()
        self._shrunk = True
        self._cutter: DeviceCutter | None = None  # made on the first `cut_kept`

    @property
    def inputs(self) -> Sequence[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> Sequence[TensorSpec]:
        return self._outputs

    @property
    def providers(self) -> Sequence[str]:
        return self._providers

    @property
    def metadata(self) -> Mapping[str, Any] | None:
        """The file's producer, opsets and metadata_props (:mod:`agent.models.onnx_header`),
        read at load; None when the header could not be read."""
        return self._metadata

    @property
    def closed(self) -> bool:
        return self._session is None

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        """Run once and return every output by name; any ORT failure is an InferenceError."""
        session = self._session  # one read: a concurrent close() cannot pull it out mid-run
        if session is None:
            raise InferenceError("session closed")
        now = time.monotonic()  # one clock read a run: the shrink's turn, and the idle clock
        shrink = self._shrink_now(now)
        try:
            values = session.run(self._output_list, dict(inputs), shrink)
        except Exception as exc:
            if shrink is None:
                raise InferenceError(one_line(exc)) from exc
            return self._run_unshrunk(session, inputs, exc)
        self._last_run, self._shrunk = now, shrink is not None
        if self._seek_idle and self._idle_inputs is None:  # no warm-up's, or too large
            base.offer_idle_inputs(self, inputs)
        return dict(zip(self._output_names, values, strict=True))

    def keep_for_idle(self, inputs: Mapping[str, npt.NDArray[Any]]) -> None:
        """Inputs this session answered (its warm-up or a request, `base.offer_idle_inputs`):
        what `release_idle` runs to shrink the arena."""
        self._idle_inputs = dict(inputs)

    def release_idle(self, idle_s: float | None = None) -> int:
        """When runs came since the arena last shrank but none for `idle_s` (None:
        `base.IDLE_RELEASE_S`): one run of the kept inputs that shrinks it (decision 0039).
        0: ONNX Runtime does not say how much it freed."""
        idle_s = base.IDLE_RELEASE_S if idle_s is None else idle_s
        session, inputs, shrink = self._session, self._idle_inputs, self._shrink
        if session is None or inputs is None or shrink is None or self._shrunk:
            return 0
        if time.monotonic() - self._last_run < idle_s:
            return 0
        try:
            session.run(self._output_list, dict(inputs), shrink)
        except Exception as exc:  # the next request's run shrinks it instead
            log.warning("%s: idle, the run to shrink its arena failed: %s", self, one_line(exc))
            self._idle_inputs, self._seek_idle = None, False
            return 0
        self._shrunk = True
        log.info("%s: idle for %.0f s or more; its memory arena shrunk", self, idle_s)
        return 0

    def _shrink_now(self, now: float) -> Any:
        """The run options that shrink the arena, once every `SHRINK_EVERY_S`; else None.
        (Two threads may both take them at the deadline: one more shrink, no harm.)"""
        if self._shrink is None:
            return None
        if now < self._next_shrink:
            return None
        self._next_shrink = now + SHRINK_EVERY_S
        return self._shrink

    def _run_unshrunk(
        self, session: Any, inputs: Mapping[str, npt.NDArray[Any]], failure: Exception
    ) -> dict[str, npt.NDArray[Any]]:
        """A run with the shrink failed: again without it. Where that one runs, the shrink
        was the cause: a GPU session asks for the CPU arena's alone from then on (its device
        arena could not be shrunk), else (an ONNX Runtime without a CPU arena) the session
        stops asking."""
        try:
            values = session.run(self._output_list, dict(inputs))
        except Exception as exc:
            raise InferenceError(one_line(exc)) from exc
        self._last_run, self._shrunk = time.monotonic(), False
        if self._shrink is not self._shrink_cpu:
            self._shrink = self._shrink_cpu
            what = "its GPU memory arena; its CPU arena's alone are shrunk from now on"
        else:
            self._shrink, self._seek_idle = None, False
            what = "its memory arena; not asked again"
        log.warning(
            "%s: ONNX Runtime refused to shrink %s (%s)", self.model_file, what, one_line(failure)
        )
        return dict(zip(self._output_names, values, strict=True))

    @property
    def device(self) -> tuple[str, int]:
        """Where the first provider keeps tensors: ("cuda", device id) for the CUDA and
        TensorRT providers, ("cpu", 0) otherwise."""
        return self._device

    @property
    def keeps_on_device(self) -> bool:
        return self._device[0] != "cpu"

    def run_keeping(self, inputs: Mapping[str, Any], keep: Collection[str]) -> dict[str, Any]:
        """Run once with ORT's IOBinding: the outputs in `keep` stay on the session's device
        as `OrtValue`s (to be bound as inputs of the next run as they are), the others are
        copied to numpy arrays; any ORT failure is an InferenceError."""
        session = self._session
        if session is None:
            raise InferenceError("session closed")
        kind, index = self._device
        try:
            binding = session.io_binding()
            for name, value in inputs.items():
                if isinstance(value, np.ndarray):
                    binding.bind_cpu_input(name, np.ascontiguousarray(value))
                else:
                    binding.bind_ortvalue_input(name, value)
            for name in self._output_names:
                if name in keep:
                    binding.bind_output(name, kind, index)
                else:
                    binding.bind_output(name, "cpu", 0)
            session.run_with_iobinding(binding)
            values = binding.get_outputs()
            return {
                name: value if name in keep else value.numpy()
                for name, value in zip(self._output_names, values, strict=True)
            }
        except Exception as exc:
            raise InferenceError(one_line(exc)) from exc

    def cut_kept(self, value: Any, axis: int, length: int) -> Any:
        """A kept output cut on its device (`base.DeviceCut`, `ort_cut.DeviceCutter`)."""
        session = self._session
        if session is None:
            raise InferenceError("session closed")
        try:
            if self._cutter is None:
                self._cutter = DeviceCutter(session, self._device)
            return self._cutter.cut(value, axis, length)
        except Exception as exc:
            raise InferenceError(one_line(exc)) from exc

    def bind_steps(
        self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], links: Mapping[str, str]
    ) -> OrtStepBinding | None:
        """The next runs of a steps loop bound once (:mod:`agent.models.backends.ort_steps`);
        None on a GPU provider, for tensors a host buffer cannot hold, or where binding fails
        (the loop then runs unbound, as before)."""
        if self._device[0] != "cpu" or set(outputs) != set(self._output_names):
            return None
        if not bindable(inputs, outputs, links):
            return None
        self._shrunk = False  # the loop's runs use the arena too (not counted in `run`)
        try:
            return OrtStepBinding(self._live, inputs, outputs, links, one_line)
        except Exception as exc:  # an ORT build without host binding: run unbound
            log.debug("%s: steps run unbound: %s", self.model_file, one_line(exc))
            return None

    def _live(self) -> Any:
        session = self._session
        if session is None:
            raise InferenceError("session closed")
        return session

    def close(self) -> None:
        """Drop the ORT session now; its memory goes when the last running call returns."""
        self._session = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else ",".join(self._providers)
        return f"<OnnxSession {self.model_file} {state}>"


class OnnxRuntimeBackend:
    """Loads ``.onnx`` files with ONNX Runtime."""

    name: str = "onnxruntime"

    def load(self, model_file: Path, options: BackendOptions) -> OnnxSession:
        """Create a session with the configured threads and providers; raise ModelLoadError."""
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ModelLoadError(
                "onnxruntime is not installed: pip install 'edge-stream-agent[cpu]'"
            ) from exc
        if options.intra_op_threads < 0:
            raise ModelLoadError(f"intra_op_threads must be >= 0, got {options.intra_op_threads}")
        problem = external_data_problem(Path(model_file))
        if problem is not None:
            raise ModelLoadError(f"cannot load {model_file}: {problem}")
        providers = select_providers(options.providers, ort.get_available_providers())
        provider_options = _provider_options(providers, options.extra)
        try:
            session = ort.InferenceSession(
                str(model_file),
                sess_options=self._session_options(ort, options),
                providers=providers,
                provider_options=provider_options,
            )
        except Exception as exc:
            raise ModelLoadError(f"cannot load {model_file}: {one_line(exc)}") from exc
        result = OnnxSession(session, Path(model_file), model_metadata(model_file))
        dropped = [p for p in providers if p not in result.providers]
        if dropped:
            log.warning(
                "%s: provider(s) %s failed to start; running on %s",
                model_file,
                ", ".join(dropped),
                ", ".join(result.providers),
            )
        return result

    @staticmethod
    def _session_options(ort: Any, options: BackendOptions) -> Any:
        """One request at a time per call, its ops in order: workers supply the parallelism."""
        so = ort.SessionOptions()
        so.intra_op_num_threads = options.intra_op_threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3  # errors only: the agent logs fallbacks itself
        return so
