"""Scanning the model repository: which models and versions exist, and what is wrong with them.

Pure functions over the file system: no threads, no loading. The watcher calls
:func:`scan_repository` again after each burst of file events and diffs the result;
the model manager loads the versions whose ``problem`` is ``None``.

Layout (see CONTRACT.md, "Model repository")::

    models/NAME/config.toml        optional for ONNX models
    models/NAME/1/model.onnx       a version is a positive integer folder
    models/NAME/2/model.plan       a TensorRT engine (.plan or .engine)
    models/NAME/2/model.sha256     optional: "HEX  model.plan" (sha256sum) or bare HEX
    models/NAME/3/genai_config.json  ONNX Runtime GenAI's folder: where there is no model.onnx,
                                   the .onnx file its model.decoder.filename names

The schema of ``config.toml`` is :mod:`agent.models.model_config`; whether a loaded model
fits it is :mod:`agent.models.signature`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.models.backends.base import ModelLoadError
from agent.models.backends.registry import backend_for_file
from agent.models.genai_config import decoder_file_of
from agent.models.model_config import CONFIG_FILE, ModelConfig, ModelConfigError, load_model_config

__all__ = [
    "CHECKSUM_FILE",
    "MODEL_FILES",
    "ModelInfo",
    "VersionInfo",
    "checksum_problem",
    "file_fingerprint",
    "parse_checksum",
    "scan_repository",
    "verify_checksum",
]

log = logging.getLogger(__name__)

CHECKSUM_FILE = "model.sha256"
MODEL_FILES = ("model.onnx", "model.plan", "model.engine")
MAX_CHECKSUM_BYTES = 4 * 1024
HASH_BLOCK = 1024 * 1024

MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
VERSION_NAME = re.compile(r"^[1-9][0-9]{0,17}$")  # positive, no leading zeros, fits int64
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
IN_PROGRESS_SUFFIXES = (".tmp", ".partial")


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

    @property
    def builds_engine(self) -> bool:
        """An ONNX file under ``backend = "tensorrt"``: the agent builds its engine
        (agent.models.engine_builds)."""
        model_file = self.model_file
        return (
            self.backend == "tensorrt" and model_file is not None and model_file.suffix == ".onnx"
        )


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


def resolved(path: Path) -> Path | None:
    """`path` resolved; None for a loop of symbolic links (Python 3.11 raises RuntimeError
    for that, later ones OSError)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return None


def _outside(path: Path, root: Path) -> str | None:
    """Links may point anywhere in the repository (2 -> 1), never out of it: why `path` is not
    in it (it resolves outside, or is a loop of links); None where it is."""
    target = resolved(path)
    if target is None:
        return "is a loop of symbolic links"
    return None if target.is_relative_to(root) else "resolves outside the repository"


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
        outside = _outside(entry, root_resolved)
        if outside is not None:
            _warn_once(f"{entry}: skipped, it {outside} ({root_resolved})")
            continue
        try:
            models[name] = _scan_model(entry, root_resolved)
        except OSError as exc:  # kept as it is (not removed): a chmod may be under way
            problem = f"cannot read the folder: {exc.strerror or exc}"
            _warn_once(f"{entry}: {problem}; its loaded versions keep serving")
            models[name] = ModelInfo(name, entry, None, problem, {})
    return models


def _scan_model(folder: Path, root: Path) -> ModelInfo:
    config: ModelConfig | None = ModelConfig()
    config_error: str | None = None
    config_path = folder / CONFIG_FILE
    if config_path.exists() or config_path.is_symlink():
        try:
            outside = _outside(config_path, root)
            if outside is not None:
                raise ModelConfigError(f"{config_path}: {outside}")
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
        elif entry.is_dir() and entry.name.isascii() and entry.name.isdigit():
            _warn_once(f"{entry}: ignored, version numbers have 1 to 18 digits, no leading 0")
        elif entry.is_dir():
            _warn_once(f"{entry}: ignored, version folders are positive integers like 1, 2, 10")
    policy = config.policy if config is not None else None
    if policy is not None and policy.version_policy == "pinned" and policy.pinned not in versions:
        _warn_once(
            f"model {folder.name}: pinned = {policy.pinned}, but there is no version folder "
            f"{policy.pinned}; the version that serves keeps serving"
        )
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

    outside = _outside(folder, root)
    if outside is not None:
        return failed(f"the version folder {outside}")
    if not folder.is_dir():
        return failed("not a folder")
    try:
        present = [
            folder / n for n in MODEL_FILES if (folder / n).exists() or (folder / n).is_symlink()
        ]
        if not present:
            try:
                present = _genai_decoder(folder)
            except ModelLoadError as exc:
                return failed(str(exc))
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
        # A plan under "onnxruntime" cannot work; an ONNX file under "tensorrt" can.
        if backend != suffix_backend and not info.builds_engine:
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


def _genai_decoder(folder: Path) -> list[Path]:
    """The decoder file an ONNX Runtime GenAI folder's `genai_config.json` names, where it is
    there (its builder may name it otherwise than model.onnx); [] where the folder has no such
    config."""
    name = decoder_file_of(folder)
    if name is None:
        return []
    if not ((folder / name).exists() or (folder / name).is_symlink()):
        raise ModelLoadError(
            f"no model file: neither model.onnx nor {name}, the decoder genai_config.json names"
        )
    return [folder / name]


def _file_problem(path: Path, root: Path) -> str | None:
    """A file the version needs is a dangling link, points outside the root, or is empty."""
    if not path.exists():
        return f"{path.name} is a broken symbolic link"
    outside = _outside(path, root)
    if outside is not None:
        return f"{path.name} {outside}"
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
    return checksum_problem(version, digest.hexdigest())


def checksum_problem(version: VersionInfo, actual: str) -> str | None:
    """The model file's sha256 ``actual`` (already computed) against model.sha256; the
    problem, or None if it matches or there is nothing to check."""
    if version.sha256_expected is None:
        return None
    if version.model_file is None:
        return "no model file to check"
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
