"""What `edge-agent request` reads from its arguments and prints of a reply's outputs."""

from __future__ import annotations

import json
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["describe_outputs", "parse_inputs", "parse_params"]


def describe_outputs(outputs: dict[str, Any], width: int = 60) -> str:
    parts = []
    for name, value in outputs.items():
        if not isinstance(value, np.ndarray):  # a seq or map output: a list or a dict
            parts.append(f"{name}={str(value)[:width]}")
            continue
        text = np.array2string(value.reshape(-1)[:8], precision=4, separator=",")
        more = "…" if value.size > 8 else ""
        parts.append(f"{name}{list(value.shape)}={text[:width]}{more}")
    return " ".join(parts)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
WAV_RATE = 16000  # the rate of the speech models' feature extractors (wav2vec2, Whisper)


def parse_inputs(
    specs: Sequence[str], texts: Sequence[str] = (), messages: Sequence[str] = ()
) -> dict[str, Any]:
    """`NAME=FILE.npy` as the array, `NAME=FILE.npz` as the archive's array called NAME (the
    inputs of a request saved together, or another request's `--save`), `NAME=FILE.jpg|.png`
    as the file's bytes (an encoded image, for a model with `[preprocess]`), `NAME=FILE.wav`
    as its samples (`read_wav`); `texts`:
    `NAME=TEXT` as a text (`parse_texts`); `messages`: `ROLE=TEXT` a message of the
    conversation (`parse_messages`)."""
    inputs: dict[str, Any] = parse_texts(texts)
    if messages:
        inputs["messages"] = parse_messages(messages)
    for spec in specs:
        name, path = _pair(spec, "--input", "NAME=FILE.npy")
        try:
            if path.lower().endswith(IMAGE_SUFFIXES):
                with open(path, "rb") as file:
                    inputs[name] = file.read()
                continue
            if path.lower().endswith(".wav"):
                inputs[name] = read_wav(path)
                continue
            inputs[name] = _array(np.load(path, allow_pickle=False), name, path)
        except (OSError, ValueError, EOFError, wave.Error) as e:  # EOFError: an empty or cut file
            raise SystemExit(f"error: cannot read {path}: {e or 'no data in the file'}") from None
    return inputs


def read_wav(path: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A 16 kHz PCM WAV file's samples as float32 `[n]` in [-1, 1), its channels averaged
    (as Hugging Face's pipelines mix them down); SystemExit for another rate (the models
    take 16 kHz: resample it first, `ffmpeg -i IN -ar 16000 -ac 1 OUT.wav`)."""
    with wave.open(path, "rb") as file:
        rate, channels, width = file.getframerate(), file.getnchannels(), file.getsampwidth()
        frames = file.readframes(file.getnframes())
    if rate != WAV_RATE:
        raise SystemExit(
            f"error: {path} is {rate} Hz; speech models take {WAV_RATE} Hz "
            f"(ffmpeg -i {path} -ar {WAV_RATE} -ac 1 OUT.wav)"
        )
    if width not in (1, 2, 4):
        raise SystemExit(f"error: {path}: {8 * width}-bit samples are not read (8, 16 or 32)")
    if width == 1:  # 8-bit WAV is unsigned
        ints = np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0
    else:
        ints = np.frombuffer(frames, dtype=np.dtype(f"<i{width}")).astype(np.float32)
    scaled = ints.reshape(-1, channels).mean(axis=1) / float(1 << (8 * width - 1))
    samples: np.ndarray[Any, np.dtype[np.float32]] = scaled.astype(np.float32)
    return samples


def _array(loaded: Any, name: str, path: str) -> Any:
    """What `np.load` gave, as the one array for input `name`: an .npz archive's array of
    that name."""
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        return loaded
    with loaded:
        if name not in loaded.files:
            held = ", ".join(loaded.files) or "none"
            raise SystemExit(f"error: {path} holds no array named {name!r} (it holds: {held})")
        return loaded[name]


def parse_texts(specs: Sequence[str]) -> dict[str, Any]:
    """`NAME=TEXT` as a text input (`prompt` of a model with a tokenizer); a NAME given more
    than once, its texts in order as a string tensor [n] (a batch of prompts, a query's
    passages as `pair`)."""
    grouped: dict[str, list[str]] = {}
    for spec in specs:
        name, text = _pair(spec, "--text", "NAME=TEXT")
        grouped.setdefault(name, []).append(text)
    return {
        name: texts[0] if len(texts) == 1 else np.array(texts, dtype=object)
        for name, texts in grouped.items()
    }


def parse_messages(specs: Sequence[str]) -> Any:
    """`ROLE=TEXT`, in order, as a conversation: the string tensor [n, 2] of (role, content)
    rows that a generate model with a chat template takes as `messages`."""
    return np.array([_pair(spec, "--message", "ROLE=TEXT") for spec in specs], dtype=object)


def parse_params(specs: Sequence[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for spec in specs:
        key, raw = _pair(spec, "--param", "KEY=VALUE")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    return params


def _pair(spec: str, option: str, form: str) -> tuple[str, str]:
    """`spec` split at its first `=`; SystemExit naming `option` and its `form` without one."""
    name, sep, value = spec.partition("=")
    if not sep:
        raise SystemExit(f"error: {option} needs {form}, got {spec!r}")
    return name, value
