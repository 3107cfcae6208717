"""The contract every backend fulfils, so the rest of the agent never imports a runtime."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

# Every tensor the agent handles; dtype and shape are checked at the edge, not typed here.
Array = npt.NDArray[Any]

# A dimension is a fixed size (int >= 0) or symbolic (a name such as "batch", or None).
Dim = int | str | None


# ONNX's names of the tensor element types numpy holds natively (the wire format carries
# these); `TensorSpec` derives its ONNX type from its dtype with it when it is given none.
ONNX_ELEMENT_DTYPES: dict[str, np.dtype[Any]] = {
    onnx_name: np.dtype(np_name)
    for onnx_name, np_name in [
        ("float", "float32"),
        ("double", "float64"),
        ("float16", "float16"),
        ("int8", "int8"),
        ("int16", "int16"),
        ("int32", "int32"),
        ("int64", "int64"),
        ("uint8", "uint8"),
        ("uint16", "uint16"),
        ("uint32", "uint32"),
        ("uint64", "uint64"),
        ("bool", "bool"),
    ]
}
_ONNX_NAMES = {dtype: name for name, dtype in ONNX_ELEMENT_DTYPES.items()}
_ONNX_NAMES[np.dtype(object)] = "string"


def onnx_type_of(dtype: np.dtype[Any]) -> str:
    """The ONNX type string of a plain tensor of ``dtype`` (``float32`` -> ``tensor(float)``)."""
    return f"tensor({_ONNX_NAMES.get(dtype, dtype.name)})"


@dataclass(frozen=True)
class TensorSpec:
    """One declared input or output of a model: what requests are checked against.

    ``type`` is the ONNX type string as ONNX Runtime spells it (``tensor(float)``,
    ``tensor(string)``, ``seq(map(int64,tensor(float)))``); left empty it is derived from
    ``dtype``, so a backend that only knows numeric tensors (TensorRT) need not spell it.
    Models with types numpy cannot hold natively still load, so that a classifier with a
    ``seq(map(...))`` output or a ``bfloat16`` input serves what it can: such specs have the
    object dtype, and non-tensors the shape ``()``; only a request that touches them fails.
    """

    name: str
    dtype: np.dtype  # type: ignore[type-arg, unused-ignore]
    shape: tuple[Dim, ...]
    type: str = ""

    def __post_init__(self) -> None:
        if not self.type:  # filled in, so specs from both spellings compare equal
            object.__setattr__(self, "type", onnx_type_of(np.dtype(self.dtype)))

    @property
    def onnx_type(self) -> str:
        """The ONNX type string (``type``, never empty)."""
        return self.type

    @property
    def is_tensor(self) -> bool:
        """A plain tensor (``tensor(...)``), not a sequence, map, optional or sparse tensor."""
        return self.type.startswith("tensor(")

    @property
    def is_numeric(self) -> bool:
        """A tensor of numbers or booleans: what the wire format carries and zeros can fill."""
        return self.is_tensor and np.dtype(self.dtype).kind in "biuf"

    @property
    def has_numpy_form(self) -> bool:
        """Not a tensor of a type numpy lacks (bfloat16, float8): such an output cannot be
        handed to Python by ONNX Runtime (strings, sequences and maps come as objects)."""
        return not (self.is_tensor and self.type != "tensor(string)" and self.dtype.kind == "O")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        """``x: float32[?,3]``; the ONNX type where numpy's name would hide it
        (``labels: tensor(string)[?]``, ``probabilities: seq(map(int64,tensor(float)))``)."""
        if not self.is_tensor:
            return f"{self.name}: {self.type}"
        dims = ",".join("?" if not isinstance(d, int) else str(d) for d in self.shape)
        kind = self.dtype.name if self.is_numeric else self.type
        return f"{self.name}: {kind}[{dims}]"


@dataclass(frozen=True)
class BackendOptions:
    """What a backend may need beyond the model file; each backend reads its own keys."""

    intra_op_threads: int = 1
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    extra: Mapping[str, object] = field(default_factory=dict)


class ModelLoadError(Exception):
    """A version's files could not be turned into a working session."""


class InferenceError(Exception):
    """A session failed while running a request (reported as `model_error`)."""


@runtime_checkable
class Session(Protocol):
    """A loaded model version. `close()` frees what it holds at a known moment."""

    @property
    def inputs(self) -> Sequence[TensorSpec]: ...

    @property
    def outputs(self) -> Sequence[TensorSpec]: ...

    @property
    def providers(self) -> Sequence[str]:
        """What really runs the model (for ONNX Runtime: `session.get_providers()`)."""
        ...

    def run(self, inputs: Mapping[str, Array]) -> dict[str, Array]:
        """Run once; raise :class:`InferenceError` on failure."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DeviceBinding(Protocol):
    """A session that can keep outputs where it made them (ONNX Runtime's IOBinding): a
    decoder's cache then stays on the GPU from one step to the next."""

    @property
    def keeps_on_device(self) -> bool:
        """True where outputs kept by `run_keeping` stay off the host (a GPU provider)."""
        ...

    def run_keeping(self, inputs: Mapping[str, Any], keep: Collection[str]) -> dict[str, Any]:
        """Run once; the outputs named in `keep` come back as the runtime's own values, to
        be given back as inputs as they are, the others as numpy arrays. An input may be
        such a value or a numpy array. Raises :class:`InferenceError` on failure."""
        ...


@runtime_checkable
class DeviceCut(Protocol):
    """A `DeviceBinding` session that can also cut a kept output on its device (ONNX
    Runtime: `agent.models.backends.ort_cut`)."""

    def cut_kept(self, value: Any, axis: int, length: int) -> Any:
        """A value `run_keeping` kept, its first `length` entries along `axis`, as a new value
        on the same device. Raises :class:`InferenceError` on failure."""
        ...


class StepBinding(Protocol):
    """A steps loop's runs bound once (ONNX Runtime's IOBinding): each run reads the fed
    inputs from the buffers the run before it wrote, and writes its outputs into the other
    of two sets, so nothing is bound, allocated or checked again a step."""

    def run(self, copied: Collection[str]) -> dict[str, Array]:
        """One step. The outputs named in `copied` are new arrays; the others are the
        binding's own buffers, written again by the run after next: to be read (fed back,
        checked) before that, never kept. Raises :class:`InferenceError`; the binding is
        then spent."""
        ...

    def close(self) -> None: ...


def bind_steps(
    session: object,
    inputs: Mapping[str, Array],
    outputs: Mapping[str, Array],
    links: Mapping[str, str],
) -> StepBinding | None:
    """A :class:`StepBinding` for the next runs of a steps loop, or None where the session
    cannot bind (it has no ``bind_steps``: TensorRT's, a test's fake) or not these tensors.

    `inputs` are the next run's, whose input `target` of each `links` entry is the output
    `source` in `outputs` (the last run's); the other inputs stay as they are. Optional, so
    not part of :class:`Session`, as :func:`session_metadata`."""
    bind = getattr(session, "bind_steps", None)
    if bind is None:
        return None
    binding = bind(inputs, outputs, links)
    return cast(StepBinding | None, binding)


def session_metadata(session: object) -> Mapping[str, Any] | None:
    """What a session says about its model file (producer, opset, ...), or None.

    Optional, so not part of :class:`Session`: a runtime-checkable protocol checks every
    member, and a session without it (TensorRT's, a test's fake) must still count as one.
    ONNX Runtime's sessions have ``metadata`` (see ``agent.models.onnx_header``).
    """
    metadata = getattr(session, "metadata", None)
    return metadata if isinstance(metadata, Mapping) else None


def session_device_bytes(session: object) -> int | None:
    """GPU memory the session holds itself (its buffers, its kept outputs), or None where it
    does not count it. Optional, as :func:`session_metadata`: the agent's TensorRT sessions
    have ``device_bytes``; ONNX Runtime's do not report theirs."""
    count = getattr(session, "device_bytes", None)
    return count if isinstance(count, int) else None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (runtimes' span several), or its type's name."""
    return " ".join(str(exc).split()) or type(exc).__name__


# A session that ran nothing for this long gives back what it keeps for runs to come
# (`release_idle_memory`): a TensorRT session its buffers, an ONNX Runtime session its arena.
IDLE_RELEASE_S = 300.0


def release_idle_memory(session: object) -> int:
    """Have a session that has been idle for `IDLE_RELEASE_S` give back the memory it keeps
    for runs to come; the bytes freed where known. Optional, as :func:`session_device_bytes`:
    the agent's TensorRT and ONNX Runtime sessions have ``release_idle``."""
    release = getattr(session, "release_idle", None)
    return int(release()) if callable(release) else 0


IDLE_INPUTS_MAX_BYTES = 1 << 20  # inputs a session keeps to shrink its memory when idle


def offer_idle_inputs(session: object, inputs: Mapping[str, Any]) -> None:
    """Inputs the session has just answered (its warm-up; without one, a request): a session
    that needs a run to give memory back when idle (ONNX Runtime's arena) keeps a copy, where
    they are small."""
    keep = getattr(session, "keep_for_idle", None)
    if not callable(keep):
        return
    arrays = [v for v in inputs.values() if isinstance(v, np.ndarray)]
    if len(arrays) == len(inputs) and sum(a.nbytes for a in arrays) <= IDLE_INPUTS_MAX_BYTES:
        keep({name: np.array(value, copy=True) for name, value in inputs.items()})


class Backend(Protocol):
    """Turns the files of one version folder into a :class:`Session`."""

    name: str

    def load(self, model_file: Path, options: BackendOptions) -> Session:
        """Raise :class:`ModelLoadError` with a readable reason on any failure."""
        ...
