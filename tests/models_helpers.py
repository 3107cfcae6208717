"""Helpers for the model repository tests: files in tmp_path, config.toml texts, an optional
extra made absent."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

MODEL_BYTES = b"\x08\x08 not really onnx, the scanner never parses it"


def put(path: Path, content: bytes | str = MODEL_BYTES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    return path


STEPS_H = "[stream]\nmode = 'steps'\nstate = { h = 'h_out' }\n"
STOP = "stop = {{ output = {}, value = {} }}\n"

FULL_CONFIG = """
backend = "onnxruntime"
[stream]
mode = "steps"
max_steps = 64
feed = { token = "next_token" }
state = { h = "h_out" }
stop = { output = "next_token", value = 0 }
emit = ["next_token"]
[inputs.token]
dtype = "int64"
shape = ["batch", 1]
[outputs.logits]
dtype = "float32"
shape = ["batch", 32]
[policy]
version_policy = "pinned"
pinned = 2
keep_loaded = 0
[backend_options]
intra_op_threads = 2
providers = ["CUDAExecutionProvider"]
"""


def hide_module(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make `import module` fail, as where an optional extra is not installed."""
    real_import = builtins.__import__

    def without(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == module:
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
