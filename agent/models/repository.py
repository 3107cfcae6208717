"""Scanning the model repository: which models and versions exist, and what is wrong with them.

Pure functions over the file system: no threads, no loading. The watcher calls
:func:`scan_repository` again after each burst of file events and diffs the result;
the model manager loads the versions whose ``problem`` is ``None``.

Layout (see CONTRACT.md, "Model repository")::

    models/NAME/config.toml        optional for ONNX models
    models/NAME/1/model.onnx       a version is a positive integer folder
    models/NAME/2/model.plan       a TensorRT engine (.plan or .engine)
    models/NAME/2/model.sha256     optional: "HEX  model.plan" (sha256sum) or bare HEX
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.inference.preprocess import PreprocessConfig
from agent.models.backends.base import BackendOptions, Dim, Session, TensorSpec
from agent.models.backends.registry import backend_for_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = [
    "CHECKSUM_FILE",
    "CONFIG_FILE",
    "MODEL_FILES",
    "BackendOptionsConfig",
    "ModelConfig",
    "ModelConfigError",
    "ModelInfo",
    "PolicyConfig",
    "StopCondition",
    "StreamConfig",
    "TensorDecl",
    "VersionInfo",
    "check_signature",
    "file_fingerprint",
    "load_model_config",
    "parse_checksum",
    "parse_model_config",
    "scan_repository",
    "verify_checksum",
]

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
CHECKSUM_FILE = "model.sha256"
MODEL_FILES = ("model.onnx", "model.plan", "model.engine")
MAX_CONFIG_BYTES = 64 * 1024  # checked before parsing: a config is a few hundred bytes
MAX_CHECKSUM_BYTES = 4 * 1024
HASH_BLOCK = 1024 * 1024

MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
VERSION_NAME = re.compile(r"^[1-9][0-9]{0,17}$")  # positive, no leading zeros, fits int64
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
IN_PROGRESS_SUFFIXES = (".tmp", ".partial")

# numpy dtype names a declared tensor may use: the ones the wire format carries.
DTYPES = frozenset(
    {"float16", "float32", "float64", "bool", "int8", "int16", "int32", "int64"}
    | {"uint8", "uint16", "uint32", "uint64"}
)


class ModelConfigError(ValueError):
    """A model's config.toml is unreadable or invalid; the message is one line."""


# --------------------------------------------------------------------------- config.toml


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

    mode: Literal["whole", "batch", "steps"] = "whole"
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
        steps_only = {"feed": bool(self.feed), "state": bool(self.state), "stop": bool(self.stop)}
        if self.mode != "steps":
            used = [key for key, present in steps_only.items() if present]
            if used:
                raise ValueError(f'{", ".join(used)} only apply to mode = "steps"')
        elif not (self.feed or self.state):
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
    applies to `whole` and `steps` (a `batch` request already runs its own slices).
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


class ModelConfig(_Strict):
    """One model's config.toml; every key is optional."""

    backend: Literal["onnxruntime", "tensorrt"] | None = None
    stream: StreamConfig = StreamConfig()
    inputs: dict[str, TensorDecl] = {}
    outputs: dict[str, TensorDecl] = {}
    policy: PolicyConfig = PolicyConfig()
    backend_options: BackendOptionsConfig = BackendOptionsConfig()
    preprocess: PreprocessConfig | None = None  # how local sources prepare frames for it
    batching: BatchingConfig = BatchingConfig()

    @model_validator(mode="after")
    def _batching_mode(self) -> ModelConfig:
        if self.batching.enabled and self.stream.mode == "batch":
            raise ValueError(
                'batching applies to mode = "whole" and "steps" (a "batch" request runs its '
                "own slices)"
            )
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
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path}: {size} bytes, more than {MAX_CONFIG_BYTES}")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ModelConfigError(f"{path}: not UTF-8 text") from None
    return parse_model_config(text, path)


def _squash(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------- signature


def check_signature(config: ModelConfig, session: Session) -> list[str]:
    """What in ``config`` does not fit the loaded model; empty when it all fits."""
    inputs = {spec.name: spec for spec in session.inputs}
    outputs = {spec.name: spec for spec in session.outputs}
    problems: list[str] = []
    for role, declared, actual in (
        ("input", config.inputs, inputs),
        ("output", config.outputs, outputs),
    ):
        for name, decl in declared.items():
            spec = actual.get(name)
            if spec is None:
                problems.append(f"declared {role} {name!r} is not in the model ({_names(actual)})")
            else:
                problems.extend(_compare_decl(role, decl, spec))
    stream = config.stream
    for kind, links in (("feed", stream.feed), ("state", stream.state)):
        for dst, src in links.items():
            problems.extend(_check_link(kind, dst, src, inputs, outputs))
    pre = config.preprocess
    if pre is not None and pre.input is not None and pre.input not in inputs:
        problems.append(f"preprocess input {pre.input!r} is not a model input ({_names(inputs)})")
    if stream.stop is not None and stream.stop.output not in outputs:
        problems.append(f"stop output {stream.stop.output!r} is not a model output")
    for name in stream.emit or ():
        if name not in outputs:
            problems.append(f"emit output {name!r} is not a model output ({_names(outputs)})")
    if stream.mode == "batch":
        for spec in session.inputs:
            if spec.rank == 0:
                problems.append(
                    f"batch mode slices the leading axis, but input {spec.name!r} is a scalar"
                )
    if config.batching.enabled:
        for role, specs in (("input", session.inputs), ("output", session.outputs)):
            for spec in specs:
                if spec.rank == 0 or isinstance(spec.shape[0], int):
                    problems.append(
                        f"[batching] needs a symbolic leading axis on every input and output; "
                        f"{role} {spec.describe()} has none"
                    )
    return problems


def _names(specs: Mapping[str, TensorSpec]) -> str:
    return "it has " + (", ".join(specs) or "none")


def _compare_decl(role: str, decl: TensorDecl, spec: TensorSpec) -> list[str]:
    problems: list[str] = []
    if spec.dtype.name != decl.dtype:
        problems.append(f"{role} {spec.name!r}: declared {decl.dtype}, model has {spec.dtype.name}")
    if len(decl.shape) != spec.rank:
        problems.append(
            f"{role} {spec.name!r}: declared rank {len(decl.shape)}, model has {spec.describe()}"
        )
    else:
        for i, (want, have) in enumerate(zip(decl.shape, spec.shape, strict=True)):
            if isinstance(want, int) and isinstance(have, int) and want != have:
                problems.append(f"{role} {spec.name!r}: dim {i} declared {want}, model has {have}")
    return problems


def _check_link(
    kind: str,
    dst: str,
    src: str,
    inputs: Mapping[str, TensorSpec],
    outputs: Mapping[str, TensorSpec],
) -> list[str]:
    """``dst`` (an input) gets ``src`` (an output of the previous step): both exist, same type."""
    problems: list[str] = []
    if dst not in inputs:
        problems.append(f"{kind} input {dst!r} is not a model input ({_names(inputs)})")
    if src not in outputs:
        problems.append(f"{kind} output {src!r} is not a model output ({_names(outputs)})")
    if problems:
        return problems
    a, b = inputs[dst], outputs[src]
    if a.dtype != b.dtype:
        problems.append(f"{kind} {dst} <- {src}: {a.dtype.name} input, {b.dtype.name} output")
    elif a.rank != b.rank or any(
        _dims_conflict(x, y) for x, y in zip(a.shape, b.shape, strict=True)
    ):
        problems.append(f"{kind} {dst} <- {src}: shapes differ ({a.describe()}; {b.describe()})")
    return problems


def _dims_conflict(a: Dim, b: Dim) -> bool:
    return isinstance(a, int) and isinstance(b, int) and a != b


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class VersionInfo:
    """One version folder as found on disk; ``problem`` says why it cannot be served."""

    model: str
    version: int
    path: Path
    model_file: Path | None
    backend: str | None
    sha256_expected: str | None
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class ModelInfo:
    """One model folder. ``config`` is the default config when there is no config.toml and
    ``None`` (with ``config_error`` set) when it is broken: such a model is not served."""

    name: str
    path: Path
    config: ModelConfig | None
    config_error: str | None
    versions: dict[int, VersionInfo]


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(message: str) -> None:
    """The watcher rescans often; the same odd entry is worth one log line, not hundreds."""
    with _warned_lock:
        if message in _warned:
            return
        if len(_warned) >= 4096:  # bounded, even if odd names keep coming
            _warned.clear()
        _warned.add(message)
    log.warning("%s", message)


def _in_progress(name: str) -> bool:
    """Hidden entries and *.tmp / *.partial are uploads or renames still under way."""
    return name.startswith(".") or name.endswith(IN_PROGRESS_SUFFIXES)


def _inside(path: Path, root: Path) -> bool:
    """Links may point anywhere in the repository (2 -> 1), never out of it."""
    return path.resolve().is_relative_to(root)


def scan_repository(root: Path) -> dict[str, ModelInfo]:
    """Every model folder under ``root``, sorted by name. Raises OSError if ``root`` is not
    a readable folder; anything wrong below it is reported in the result instead."""
    root_resolved = Path(root).resolve(strict=True)
    if not root_resolved.is_dir():
        raise NotADirectoryError(f"model repository {root} is not a folder")
    models: dict[str, ModelInfo] = {}
    for entry in sorted(root_resolved.iterdir(), key=lambda p: p.name):
        name = entry.name
        if _in_progress(name) or not entry.is_dir():
            continue
        if not MODEL_NAME.match(name):
            _warn_once(f"{entry}: skipped, model names match {MODEL_NAME.pattern}")
            continue
        if not _inside(entry, root_resolved):
            _warn_once(f"{entry}: skipped, it resolves outside the repository {root_resolved}")
            continue
        try:
            models[name] = _scan_model(entry, root_resolved)
        except OSError as exc:
            _warn_once(f"{entry}: skipped, cannot read: {exc.strerror or exc}")
    return models


def _scan_model(folder: Path, root: Path) -> ModelInfo:
    config: ModelConfig | None = ModelConfig()
    config_error: str | None = None
    config_path = folder / CONFIG_FILE
    if config_path.exists() or config_path.is_symlink():
        try:
            if not _inside(config_path, root):
                raise ModelConfigError(f"{config_path}: resolves outside the repository")
            config = load_model_config(config_path)
        except ModelConfigError as exc:
            config, config_error = None, str(exc)
            _warn_once(f"model {folder.name} not served: {config_error}")
    versions: dict[int, VersionInfo] = {}
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if _in_progress(entry.name) or entry.name == CONFIG_FILE:
            continue
        if VERSION_NAME.match(entry.name):
            number = int(entry.name)
            versions[number] = _scan_version(folder.name, number, entry, root, config)
        elif entry.is_dir():
            _warn_once(f"{entry}: ignored, version folders are positive integers like 1, 2, 10")
    return ModelInfo(
        name=folder.name,
        path=folder,
        config=config,
        config_error=config_error,
        versions=dict(sorted(versions.items())),
    )


def _scan_version(
    model: str, number: int, folder: Path, root: Path, config: ModelConfig | None
) -> VersionInfo:
    info = VersionInfo(model, number, folder, None, None, None, None)

    def failed(problem: str, **found: Any) -> VersionInfo:
        return dataclasses.replace(info, problem=problem, **found)

    if not _inside(folder, root):
        return failed("the version folder resolves outside the repository")
    if not folder.is_dir():
        return failed("not a folder")
    try:
        present = [
            folder / n for n in MODEL_FILES if (folder / n).exists() or (folder / n).is_symlink()
        ]
        if not present:
            return failed(f"no model file (expected one of {', '.join(MODEL_FILES)})")
        if len(present) > 1:
            return failed(f"several model files: {', '.join(p.name for p in present)}")
        model_file = present[0]
        suffix_backend = backend_for_file(model_file)
        backend = config.backend if config is not None and config.backend else suffix_backend
        info = dataclasses.replace(info, model_file=model_file, backend=backend)
        problem = _file_problem(model_file, root)
        if problem is not None:
            return failed(problem)
        if backend != suffix_backend:
            return failed(
                f"config says backend {backend!r}, but {model_file.name} is a {suffix_backend} file"
            )
        checksum_file = folder / CHECKSUM_FILE
        if checksum_file.exists() or checksum_file.is_symlink():
            problem = _file_problem(checksum_file, root)
            if problem is not None:
                return failed(problem)
            try:
                digest = parse_checksum(_read_small(checksum_file), model_file.name)
            except ValueError as exc:
                return failed(str(exc))
            info = dataclasses.replace(info, sha256_expected=digest)
    except OSError as exc:
        return failed(f"cannot read: {exc.strerror or exc}")
    return info


def _file_problem(path: Path, root: Path) -> str | None:
    """A file the version needs is a dangling link, points outside the root, or is empty."""
    if not path.exists():
        return f"{path.name} is a broken symbolic link"
    if not _inside(path, root):
        return f"{path.name} resolves outside the repository"
    if not path.is_file():
        return f"{path.name} is not a regular file"
    if path.name != CHECKSUM_FILE and path.stat().st_size == 0:
        return f"{path.name} is empty"
    return None


def _read_small(path: Path) -> str:
    with path.open("rb") as f:
        data = f.read(MAX_CHECKSUM_BYTES + 1)
    if len(data) > MAX_CHECKSUM_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_CHECKSUM_BYTES} bytes")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path.name} is not a sha256 digest (not ASCII text)") from None


def parse_checksum(text: str, model_name: str) -> str:
    """The expected digest for ``model_name`` from sha256sum output or a bare hex digest."""
    digests: set[str] = set()
    seen_any = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        seen_any = True
        digest, _, named = line.partition(" ")
        digest = digest.lower()
        if not SHA256_HEX.match(digest):
            raise ValueError(f"{CHECKSUM_FILE} is not a sha256 digest: {line[:80]!r}")
        filename = named.strip().lstrip("*")
        if not filename or Path(filename).name == model_name:
            digests.add(digest)
    if not seen_any:
        raise ValueError(f"{CHECKSUM_FILE} is empty")
    if not digests:
        raise ValueError(f"{CHECKSUM_FILE} has no digest for {model_name}")
    if len(digests) > 1:
        raise ValueError(f"{CHECKSUM_FILE} has several digests for {model_name}")
    return digests.pop()


def verify_checksum(version: VersionInfo) -> str | None:
    """Hash the model file (1 MiB blocks) against model.sha256; the problem, or None if it
    matches or there is nothing to check. Slow for big engines: run it off the scan path."""
    if version.sha256_expected is None:
        return None
    if version.model_file is None:
        return "no model file to check"
    digest = hashlib.sha256()
    try:
        with version.model_file.open("rb") as f:
            while block := f.read(HASH_BLOCK):
                digest.update(block)
    except OSError as exc:
        return f"cannot read {version.model_file.name}: {exc.strerror or exc}"
    actual = digest.hexdigest()
    if actual != version.sha256_expected:
        return (
            f"checksum mismatch for {version.model_file.name}: "
            f"expected {version.sha256_expected}, got {actual}"
        )
    return None


def file_fingerprint(path: Path) -> tuple[int, int]:
    """(size, mtime_ns), following links: a file counts as complete once this stops changing."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
