"""Warm-up: one run before a version serves, on inputs a valid model accepts.

A run before serving pays the first-run allocation cost up front and catches a model that
loads but cannot run. Where the inputs come from decides what a failure means:

* **explicit**: the model's ``[warmup]`` section (``file``: an ``.npz`` in the version folder,
  ``inputs``: ``NAME = {shape, value}``; inputs it does not name get synthetic values). The
  operator said what the model takes, so a failure fails the version.
* **synthetic**: sizes and values guessed from the signature. A guess can be wrong for a
  valid model (a shape check between two symbolic dims, a window the model needs), so a
  failure serves the version cold: ``skipped: <reason>`` in the inventory, one warning.
  Not where it would replace a serving version that warmed up: the guess fitted the model
  then, so the new file is at fault, and the version fails as the contract says.
* **off**: ``[models] warmup = false`` for the agent, or ``[warmup] enabled = false``.

The guesses (:func:`synthetic_inputs`) follow what exporters name their dimensions: optimum
writes ``batch_size``, ``sequence_length``, ``past_sequence_length`` and sums such as
``past_sequence_length + sequence_length``; image models take ``[N, C, H, W]`` or
``[N, H, W, C]`` with 1, 3 or 4 channels; audio models take a sample-rate scalar or, as
Hugging Face's speech encoders do, samples named ``input_values`` ``[batch, samples]``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.backends.base import (
    Dim,
    InferenceError,
    ModelLoadError,
    Session,
    TensorSpec,
    offer_idle_inputs,
)
from agent.models.model_config import WarmupConfig

__all__ = [
    "IMAGE_SIDE",
    "WARMUP_OFF",
    "WARMUP_OK",
    "explicit_inputs",
    "run_warm_up",
    "synthetic_inputs",
    "warm_up",
]

log = logging.getLogger(__name__)

_TEXT = "tensor(string)"
WARMUP_OK = "ok"
WARMUP_OFF = "off"

BATCH = 1
SEQUENCE = 4  # tokens in a synthetic prompt; past length the same
IMAGE_SIDE = 224  # a multiple of 32: survives the five halvings of common backbones
AUDIO_WINDOW = 512  # samples: 32 ms at 16 kHz, the window VAD models such as silero take
SAMPLE_RATE = 16000
MAX_WARMUP_FILE_BYTES = 256 * 1024 * 1024
_REASON_CHARS = 200

_SAMPLE_RATE_NAME = re.compile(r"(^|_)(sr|sample_?rate|sampling_?rate|rate)$")
_CHANNELS = (1, 3, 4)

Arrays = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class _Sizes:
    """What the synthetic guesses know about the whole model (some rules look across inputs)."""

    # the model takes a sample-rate scalar or speech samples: its free lengths are audio
    # windows (a wav2vec2's convolutions refuse a few samples)
    audio: bool


def _word_size(word: str, sizes: _Sizes) -> int:
    """The size of one named dimension (one term of a sum such as ``past + sequence``)."""
    if word.isdigit():
        return int(word)
    name = word.lower()
    if "batch" in name:
        return BATCH
    if "total" in name and ("seq" in name or "len" in name):
        return 2 * SEQUENCE  # past + new tokens
    if "past" in name or "seq" in name or "len" in name or "token" in name:
        return AUDIO_WINDOW if sizes.audio and "past" not in name else SEQUENCE
    if name in ("h", "w") or "height" in name or "width" in name:
        return IMAGE_SIDE
    return AUDIO_WINDOW if sizes.audio else 1


def _named_size(name: str, sizes: _Sizes) -> int:
    terms = [t.strip() for t in name.split("+")]
    if len(terms) > 1 and all(terms):
        return sum(_word_size(t, sizes) for t in terms)
    return _word_size(name, sizes)


def _image_axes(shape: Sequence[Dim]) -> tuple[int, ...]:
    """The spatial axes of an image-like input (rank 4, a fixed 1/3/4-channel axis)."""
    if len(shape) != 4:
        return ()
    if shape[1] in _CHANNELS and not isinstance(shape[2], int) and not isinstance(shape[3], int):
        return (2, 3)
    if shape[3] in _CHANNELS and not isinstance(shape[1], int) and not isinstance(shape[2], int):
        return (1, 2)
    return ()


def _shape(spec: TensorSpec, sizes: _Sizes) -> tuple[int, ...]:
    image = _image_axes(spec.shape)
    dims: list[int] = []
    for axis, dim in enumerate(spec.shape):
        if isinstance(dim, int):
            dims.append(dim)
        elif axis in image and not (isinstance(dim, str) and "batch" in dim.lower()):
            dims.append(IMAGE_SIDE)
        elif axis == 0 and len(spec.shape) > 1 and not isinstance(dim, str):
            dims.append(BATCH)  # an unnamed leading axis is a batch
        elif isinstance(dim, str):
            dims.append(_named_size(dim, sizes))
        else:
            dims.append(AUDIO_WINDOW if sizes.audio and axis == len(spec.shape) - 1 else 1)
    return tuple(dims)


def _is_sample_rate(spec: TensorSpec) -> bool:
    return (
        spec.rank == 0
        and spec.dtype.kind in "iu"
        and _SAMPLE_RATE_NAME.search(spec.name.lower()) is not None
    )


def _is_speech_samples(spec: TensorSpec) -> bool:
    """Raw samples as optimum exports wav2vec2, HuBERT, WavLM: `input_values` float
    `[batch, samples]` (a spectrogram's `input_values` has rank 3)."""
    return spec.name == "input_values" and spec.dtype.kind == "f" and spec.rank == 2


def _fill(spec: TensorSpec, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """Zeros, except where zero is nonsense: a sample rate, other numeric scalars (counts,
    k, lengths), and masks (an all-zero attention mask masks everything)."""
    kind = spec.dtype.kind
    if kind == "O":  # tensor(string)
        return np.full(shape, "a", dtype=object)
    if _is_sample_rate(spec):
        return np.full(shape, SAMPLE_RATE, dtype=spec.dtype)
    if kind in "iuf" and (spec.rank == 0 or "mask" in spec.name.lower()):
        return np.ones(shape, dtype=spec.dtype)
    return np.zeros(shape, dtype=spec.dtype)


def synthetic_inputs(
    session: Session, known: Mapping[str, npt.NDArray[Any]] | None = None
) -> Arrays:
    """Plausible inputs for every declared input, from the signature alone; `known` (the
    model's `[defaults]`, a scan's window) replace the guesses."""
    audio = any(_is_sample_rate(spec) or _is_speech_samples(spec) for spec in session.inputs)
    sizes = _Sizes(audio=audio)
    guessed = {spec.name: _fill(spec, _shape(spec, sizes)) for spec in session.inputs}
    return {**guessed, **(known or {})}


def explicit_inputs(
    session: Session,
    config: WarmupConfig,
    folder: Path,
    known: Mapping[str, npt.NDArray[Any]] | None = None,
) -> Arrays:
    """The ``[warmup]`` section's inputs over synthetic ones; ModelLoadError on a bad file."""
    specs = {spec.name: spec for spec in session.inputs}
    given: Arrays = {}
    if config.file is not None:
        given.update(_read_npz(folder / config.file))
    unknown = sorted((set(given) | set(config.inputs)) - set(specs))
    if unknown:
        raise ModelLoadError(
            f"[warmup] names input(s) {', '.join(unknown)} the model does not have "
            f"(it has {', '.join(specs) or 'none'})"
        )
    for name, table in config.inputs.items():
        given[name] = np.full(tuple(table.shape), table.value, dtype=specs[name].dtype)
    return {**synthetic_inputs(session, known), **given}


def _read_npz(path: Path) -> Arrays:
    try:
        size = path.stat().st_size
        if size > MAX_WARMUP_FILE_BYTES:
            raise ModelLoadError(f"[warmup] file {path.name}: {size} bytes, over the limit")
        with np.load(path, allow_pickle=False) as data:
            return {name: np.asarray(data[name]) for name in data.files}
    except ModelLoadError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"[warmup] file {path.name}: {_one_line(exc)}") from None


def warm_up(session: Session, inputs: Mapping[str, npt.NDArray[Any]] | None = None) -> None:
    """One run on ``inputs`` (default: synthetic); every output must come back (but those
    numpy has no type for, which are never fetched). Raises :class:`InferenceError`."""
    given = synthetic_inputs(session) if inputs is None else inputs
    outputs = session.run(given)
    expected = [spec.name for spec in session.outputs if spec.has_numpy_form]
    missing = [name for name in expected if name not in outputs]
    if missing:
        raise InferenceError(f"warm-up returned no {', '.join(missing)}")
    offer_idle_inputs(session, given)  # known to run: a run when idle can shrink its memory


def run_warm_up(
    session: Session,
    config: WarmupConfig,
    folder: Path,
    *,
    enabled: bool,
    known: Mapping[str, npt.NDArray[Any]] | None = None,
    replacing: int | None = None,
) -> str:
    """Warm ``session`` up as the model's config says; the inventory's ``warmup`` value.
    ``known``: inputs the config fixes (``[defaults]``), used instead of guesses.

    An explicit warm-up that fails raises :class:`ModelLoadError` (the version fails); a
    synthetic one that fails is logged once and reported as ``skipped: <reason>``, except
    where the version would replace ``replacing``, a serving version whose own guessed or
    explicit warm-up ran: that guess fitted the model, so the new file is more likely at
    fault than the guess, and the version fails (CONTRACT: the old one keeps serving).
    """
    if not enabled or not config.enabled:
        return WARMUP_OFF
    if config.explicit:
        inputs = explicit_inputs(session, config, folder, known)
        try:
            warm_up(session, inputs)
        except InferenceError as exc:
            raise ModelLoadError(f"warm-up ([warmup] inputs) failed: {_reason(exc)}") from exc
        return WARMUP_OK
    unguessable = [s for s in session.inputs if not s.is_numeric and s.onnx_type != _TEXT]
    if unguessable:
        spec = unguessable[0]
        log.warning("%s: no synthetic value for %s; serving it cold", folder, spec.describe())
        return f"skipped: input {spec.name!r} is {spec.onnx_type} (no synthetic value)"
    try:
        warm_up(session, synthetic_inputs(session, known))
    except Exception as exc:  # a guess the model refuses, in whatever form its runtime says
        reason = _reason(exc)[:_REASON_CHARS]
        if replacing is not None:
            raise ModelLoadError(
                f"warm-up failed ({reason}) on inputs that v{replacing}, serving, ran: "
                f"v{replacing} keeps serving (if they do not fit this version, give it real "
                "inputs in config.toml [warmup])"
            ) from exc
        log.warning(
            "%s: synthetic warm-up failed, serving it cold (give real inputs in its "
            "config.toml [warmup] section): %s",
            folder,
            reason,
        )
        return f"skipped: {reason}"
    return WARMUP_OK


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_CHECK = re.compile(r"^/\S+:\d+ .*? was false\. ")


def _reason(exc: BaseException) -> str:
    """The part of a runtime's error a person needs: for ONNX Runtime, the node and its
    message, without the error-code prefix and the C++ source location."""
    text = _ORT_PREFIX.sub("", _one_line(exc))
    node, found, message = text.partition(" Status Message: ")
    if not found:
        return text
    node = node.replace("Non-zero status code returned while running ", "").rstrip(".")
    return f"{node}: {_ORT_CHECK.sub('', message)}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
