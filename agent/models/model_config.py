"""The schema of a model's ``config.toml``: how it streams, batches, which version serves.

Every key is optional (an ONNX model needs no config at all). TOML has real types, so the
models are strict: no coercion and no unknown keys, and every problem comes back as one
line naming the file and the key (:class:`ModelConfigError`). The repository scanner reads
each model's file through :func:`load_model_config`; the inference package reads
:class:`StreamConfig` and :class:`BatchingConfig` from the parsed result.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.models.backends.base import BackendOptions
from agent.models.generate_config import GenerateConfig
from agent.models.postprocess import PostprocessOp
from agent.models.preprocess import PreprocessConfig
from agent.models.scan_config import ScanConfig, check_default_values
from agent.models.text_file import read_text_limited

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "CONFIG_FILE",
    "DTYPES",
    "BackendOptionsConfig",
    "BatchingConfig",
    "ModelConfig",
    "ModelConfigError",
    "PolicyConfig",
    "ScanConfig",
    "StopCondition",
    "StreamConfig",
    "TensorDecl",
    "WarmupConfig",
    "WarmupInput",
    "load_model_config",
    "parse_model_config",
]

CONFIG_FILE = "config.toml"
MAX_CONFIG_BYTES = 64 * 1024  # checked before parsing: a config is a few hundred bytes
MAX_WARMUP_ELEMENTS = 1 << 24  # per [warmup] input: a warm-up is one small request

# numpy dtype names a declared tensor may use: the ones the wire format carries.
DTYPES = frozenset(
    {"float16", "float32", "float64", "bool", "int8", "int16", "int32", "int64"}
    | {"uint8", "uint16", "uint32", "uint64"}
)


class ModelConfigError(ValueError):
    """A model's config.toml is unreadable or invalid; the message is one line."""


class _Strict(BaseModel):
    """TOML has real types, so no coercion ("4" is not 4) and no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StopCondition(_Strict):
    """Steps mode ends early when ``output`` equals ``value`` (every batch item, if batched)."""

    output: str = Field(min_length=1)
    value: Any

    @field_validator("value")
    @classmethod
    def _number(cls, v: Any) -> int | float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError("must be a number")
        return v


class StreamConfig(_Strict):
    """How one request's output is cut into chunks."""

    mode: Literal["whole", "batch", "steps", "scan", "generate"] = "whole"
    micro_batch: int = Field(default=1, ge=1)
    max_steps: int = Field(default=32, ge=1, le=100_000)
    feed: dict[str, str] = {}
    state: dict[str, str] = {}
    stop: StopCondition | None = None
    emit: list[str] | None = None

    @field_validator("emit")
    @classmethod
    def _emit_names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if not v:
                raise ValueError("must name at least one output")
            if len(set(v)) != len(v):
                raise ValueError("names an output twice")
        return v

    @model_validator(mode="after")
    def _steps_keys(self) -> StreamConfig:
        # `state` also applies to a scan: it is carried from window to window.
        carried = ("feed", "stop") if self.mode == "scan" else ("feed", "state", "stop")
        used = [key for key in carried if getattr(self, key)]
        if self.mode != "steps" and used:
            raise ValueError(f'{", ".join(used)} only apply to mode = "steps"')
        if self.mode == "steps" and not (self.feed or self.state):
            raise ValueError('mode = "steps" needs feed or state (what carries over a step)')
        both = sorted(set(self.feed) & set(self.state))
        if both:
            raise ValueError(f"input(s) {', '.join(both)} set by both feed and state")
        return self

    def emitted(self, output_names: Sequence[str]) -> list[str]:
        """The outputs each chunk carries: ``emit``, or every output but the state outputs."""
        if self.emit is not None:
            return list(self.emit)
        state_outputs = set(self.state.values())
        return [name for name in output_names if name not in state_outputs]


class BatchingConfig(_Strict):
    """Dynamic batching (Triton's `dynamic_batching`): requests for this model that are queued
    together run as one batch along the leading axis, and each still streams its own replies.

    Off unless `max_batch` > 1. Needs a symbolic leading axis on every input and output, and
    applies to `whole`, `steps` and `generate` (a `batch` request already runs its own
    slices; a generate request is one row, its steps run in lock-step with the others').
    """

    max_batch: int = Field(default=1, ge=1, le=65536)  # leading-axis items in one run
    max_queue_delay_us: int = Field(default=0, ge=0, le=1_000_000)  # wait for more requests

    @property
    def enabled(self) -> bool:
        return self.max_batch > 1


class TensorDecl(_Strict):
    """A declared input or output, checked against the model's real signature at load."""

    dtype: str
    shape: list[Any]

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"unknown dtype {v!r} (one of {', '.join(sorted(DTYPES))})")
        return v

    @field_validator("shape")
    @classmethod
    def _dims(cls, v: list[Any]) -> list[Any]:
        for d in v:
            ok_int = isinstance(d, int) and not isinstance(d, bool) and d >= 0
            if not (ok_int or (isinstance(d, str) and d)):
                raise ValueError(f"dims are sizes >= 0 or names, got {d!r}")
        return v


class PolicyConfig(_Strict):
    """Which version serves, and how many older ones stay loaded for pinned requests."""

    version_policy: Literal["latest", "pinned"] = "latest"
    pinned: int | None = Field(default=None, ge=1)
    keep_loaded: int = Field(default=1, ge=0)
    # A new version must have the inputs and outputs of the one it replaces (names, dtypes,
    # ranks, fixed dims), so subscribers and requesters need no change; false allows any.
    require_compatible: bool = True

    @model_validator(mode="after")
    def _pinned_needs_version(self) -> PolicyConfig:
        if self.version_policy == "pinned" and self.pinned is None:
            raise ValueError('version_policy = "pinned" needs pinned = VERSION')
        if self.version_policy == "latest" and self.pinned is not None:
            raise ValueError('pinned is set but version_policy is "latest"')
        return self

    def candidates(self, versions: Collection[int]) -> list[int]:
        """The versions to try for serving, in order: the pinned one, else newest first."""
        if self.version_policy == "pinned" and self.pinned is not None:
            return [self.pinned] if self.pinned in versions else []
        return sorted(versions, reverse=True)


class BackendOptionsConfig(_Strict):
    """Per-model overrides of the agent-wide backend options."""

    intra_op_threads: int | None = Field(default=None, ge=0)
    providers: list[str] | None = None
    # Backend-specific tables merged over the agent's [models.backend_options]: "gpu" (ONNX
    # Runtime TensorRT/CUDA provider settings), "provider_options", "tensorrt".
    gpu: dict[str, Any] | None = None
    provider_options: dict[str, dict[str, Any]] | None = None
    tensorrt: dict[str, Any] | None = None

    def apply(self, base: BackendOptions) -> BackendOptions:
        """``base`` with this model's overrides."""
        changes: dict[str, Any] = {}
        if self.intra_op_threads is not None:
            changes["intra_op_threads"] = self.intra_op_threads
        if self.providers is not None:
            changes["providers"] = tuple(self.providers)
        extra: dict[str, object] = dict(base.extra)
        for key in ("gpu", "provider_options", "tensorrt"):
            value = getattr(self, key)
            if value is not None:
                inherited = extra.get(key)
                merged = dict(inherited) if isinstance(inherited, Mapping) else {}
                extra[key] = {**merged, **value}
        changes["extra"] = extra
        return dataclasses.replace(base, **changes)


class WarmupInput(_Strict):
    """One input of an explicit warm-up: ``shape`` filled with ``value``."""

    shape: list[int] = []
    value: int | float | bool | str = 0

    @field_validator("shape")
    @classmethod
    def _sizes(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError("dims must be >= 0")
        if len(v) > 16 or math.prod(v) > MAX_WARMUP_ELEMENTS:
            raise ValueError(f"at most 16 dims and {MAX_WARMUP_ELEMENTS} elements")
        return v


class WarmupConfig(_Strict):
    """``[warmup]``: real warm-up inputs for a model the synthetic guesses do not fit.

    ``file`` is an ``.npz`` in the version folder (one array per input name); ``inputs``
    gives ``NAME = {shape, value}`` and wins over the file. Inputs neither names get the
    synthetic values. With either set, a failing warm-up fails the version.
    """

    enabled: bool = True
    file: str | None = None
    inputs: dict[str, WarmupInput] = {}

    @field_validator("file")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or "\\" in v or v in (".", "..")):
            raise ValueError("must be a file name in the version folder (no folders)")
        return v

    @property
    def explicit(self) -> bool:
        return self.file is not None or bool(self.inputs)


class ModelConfig(_Strict):
    """One model's config.toml; every key is optional."""

    backend: Literal["onnxruntime", "tensorrt"] | None = None
    stream: StreamConfig = StreamConfig()
    inputs: dict[str, TensorDecl] = {}
    outputs: dict[str, TensorDecl] = {}
    policy: PolicyConfig = PolicyConfig()
    backend_options: BackendOptionsConfig = BackendOptionsConfig()
    preprocess: PreprocessConfig | None = None  # how local sources and image inputs are prepared
    postprocess: list[PostprocessOp] = []  # ops on the outputs (agent.models.postprocess)
    batching: BatchingConfig = BatchingConfig()
    warmup: WarmupConfig = WarmupConfig()
    scan: ScanConfig | None = None  # mode = "scan": the windows
    generate: GenerateConfig | None = None  # mode = "generate": overrides of the layout
    # An input's value when a request leaves it out (`sr = 16000`); checked against the
    # model's signature at load (agent.models.defaults).
    defaults: dict[str, Any] = {}

    @field_validator("defaults")
    @classmethod
    def _default_values(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_default_values(v)

    @model_validator(mode="after")
    def _batching_mode(self) -> ModelConfig:
        if self.batching.enabled and self.stream.mode in ("batch", "scan"):
            raise ValueError(
                'batching applies to mode = "whole" and "steps" (a "batch" request runs its '
                'own slices, a "scan" request its own windows)'
            )
        if (self.stream.mode == "scan") != (self.scan is not None):
            raise ValueError('mode = "scan" and a [scan] section go together')
        if self.generate is not None and self.stream.mode != "generate":
            raise ValueError('a [generate] section needs mode = "generate"')
        return self


def _format_errors(exc: ValidationError) -> str:
    parts: list[str] = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_model_config(text: str, source: Path | str) -> ModelConfig:
    """Parse config.toml text; ModelConfigError names the file and each bad key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ModelConfigError(f"{source}: invalid TOML: {_squash(str(exc))}") from None
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise ModelConfigError(f"{source}: {_format_errors(exc)}") from None


def load_model_config(path: Path) -> ModelConfig:
    """Read and parse one config.toml, with the size checked before reading."""
    text = read_text_limited(
        path,
        MAX_CONFIG_BYTES,
        too_large=lambda size: ModelConfigError(
            f"{path}: {size} bytes, more than {MAX_CONFIG_BYTES}"
        ),
        cannot_read=lambda exc: ModelConfigError(f"{path}: cannot read: {exc.strerror or exc}"),
        not_text=lambda _: ModelConfigError(f"{path}: not UTF-8 text"),
    )
    return parse_model_config(text, path)


def _squash(text: str) -> str:
    return " ".join(text.split())
