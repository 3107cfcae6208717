"""The contract every backend fulfils, so the rest of the agent never imports a runtime."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

# Every tensor the agent handles; dtype and shape are checked at the edge, not typed here.
Array = npt.NDArray[Any]

# A dimension is a fixed size (int >= 0) or symbolic (a name such as "batch", or None).
Dim = int | str | None


@dataclass(frozen=True)
class TensorSpec:
    """One declared input or output of a model: what requests are checked against."""

    name: str
    dtype: np.dtype  # type: ignore[type-arg, unused-ignore]
    shape: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        dims = ",".join("?" if not isinstance(d, int) else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype.name}[{dims}]"


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


class Backend(Protocol):
    """Turns the files of one version folder into a :class:`Session`."""

    name: str

    def load(self, model_file: Path, options: BackendOptions) -> Session:
        """Raise :class:`ModelLoadError` with a readable reason on any failure."""
        ...
