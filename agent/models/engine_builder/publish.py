"""Writing to disk so that a crash leaves no half file, and publishing a plan as a version.

A version is written into a hidden temporary folder and renamed into place as ``N+1/``
(``model.plan``, ``model.sha256``, ``build.json``), with the model folder locked, so the
watcher never sees half an engine; :func:`published` finds a version that already holds
the same build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent.models.model_config import ModelConfigError, load_model_config

__all__ = [
    "BUILD_INFO",
    "CHECKSUM_FILE",
    "LOCK_FILE",
    "PLAN_FILE",
    "VERSION_NAME",
    "locked",
    "publish",
    "published",
    "sha256_file",
    "version_numbers",
    "warn_about_config",
    "write_atomic",
]

log = logging.getLogger(__name__)

PLAN_FILE = "model.plan"
CHECKSUM_FILE = "model.sha256"
BUILD_INFO = "build.json"
LOCK_FILE = ".build.lock"
VERSION_NAME = re.compile(r"^[1-9][0-9]{0,17}$")
HASH_BLOCK = 1024 * 1024


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Temporary file in the same folder, fsync, rename: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def locked(model_dir: Path) -> Iterator[None]:
    """One build per model folder at a time on this box (a hidden lock file, flock)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not Linux
        yield
        return
    with (model_dir / LOCK_FILE).open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def version_numbers(model_dir: Path) -> list[int]:
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if VERSION_NAME.match(p.name))


def published(model_dir: Path, key: str) -> Path | None:
    """A version folder already holding the plan for ``key`` (intact), if any."""
    for number in reversed(version_numbers(model_dir)):
        folder = model_dir / str(number)
        try:
            info = json.loads((folder / BUILD_INFO).read_text())
            plan = folder / PLAN_FILE
            if (
                info.get("key") == key
                and plan.is_file()
                and sha256_file(plan) == info.get("plan_sha256")
            ):
                return plan
        except (OSError, ValueError, AttributeError):
            continue
    return None


def publish(model_dir: Path, plan: bytes, info: dict[str, Any]) -> Path:
    """Write ``N+1/`` into a hidden temporary folder, then rename it into place.

    The repository scanner skips hidden and ``*.tmp`` names, so the version appears whole
    or not at all. Called with the model folder locked; the rename still refuses to land
    on a folder that appeared meanwhile (another tool): it then takes the next number.
    """
    digest = hashlib.sha256(plan).hexdigest()
    info = {**info, "plan_sha256": digest}
    tmp = model_dir / f".build-{info['key'][:12]}-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_file(tmp / PLAN_FILE, plan)
        write_file(tmp / CHECKSUM_FILE, f"{digest}  {PLAN_FILE}\n".encode())
        write_file(tmp / BUILD_INFO, (json.dumps(info, indent=2, sort_keys=True) + "\n").encode())
        fsync_dir(tmp)
        number = (version_numbers(model_dir) or [0])[-1] + 1
        while True:
            target = model_dir / str(number)
            if not target.exists():
                try:
                    os.rename(tmp, target)
                    break
                except OSError:
                    if not target.exists():
                        raise
            number += 1
        fsync_dir(model_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target / PLAN_FILE


def warn_about_config(model_dir: Path) -> None:
    """A model whose config.toml pins ``backend = "onnxruntime"`` would refuse the plan."""
    config_path = model_dir / "config.toml"
    if not config_path.exists():
        return
    try:
        config = load_model_config(config_path)
    except ModelConfigError as exc:
        log.warning("%s", exc)
        return
    if config.backend == "onnxruntime":
        log.warning(
            '%s says backend = "onnxruntime": the new model.plan version will be marked '
            'failed until that line is removed or set to "tensorrt"',
            config_path,
        )
