"""A speech model's samples normalised as its Hugging Face feature extractor normalises them.

wav2vec2, HuBERT, WavLM and data2vec-audio read raw samples (`input_values [batch, samples]`,
16 kHz mono, floats in [-1, 1]), but trained on each recording scaled to zero mean and unit
variance; their `preprocessor_config.json` (`Wav2Vec2FeatureExtractor`, `do_normalize: true`)
says so. For such a version each row of `input_values` is normalised as
`Wav2Vec2FeatureExtractor` does it, `(x - mean) / sqrt(var + 1e-7)` in float32, before it
runs; a client sends the samples as it records them. Normalising is idempotent, so a client
that already normalises gets the same. What a row is depends on the mode:

- `whole` and `batch`: a request's recording is the utterance, normalised once;
- `scan` over `input_values` (a request's recording, a session's pieces or a pcm source's
  live samples, cut into windows): each window, as the model sees it (its `lead` zeros
  included), is normalised on its own, as `processor(window)` would be: a window's samples
  are then the same whether the recording came in one request, in a session's pieces or from
  a live source (`per_window`).

Imports only `backends.base` and `hf_files`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import Array, TensorSpec
from agent.models.hf_files import read_json, whole_number

__all__ = ["AudioNormalization", "open_audio_normalization"]

AUDIO_INPUT = "input_values"  # what Hugging Face's speech encoders name their samples
NORMALIZING_EXTRACTORS = frozenset({"Wav2Vec2FeatureExtractor"})
MODES = frozenset({"whole", "batch", "scan"})  # not steps or generate: no recording to scan
_EPSILON = np.float32(1e-7)
_FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class AudioNormalization:
    """The input whose rows are normalised, and whether per window of a scan."""

    input: str
    per_window: bool = False  # a scan over `input`: each window, not the request's recording
    sample_rate: int | None = None  # the feature extractor's `sampling_rate`

    def apply(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """`inputs` with the samples' rows normalised (a new array); samples of another dtype
        or rank are left to the input checks, which name the problem."""
        value = inputs.get(self.input)
        if not isinstance(value, np.ndarray) or value.dtype != _FLOAT32 or value.ndim != 2:
            return inputs
        return {**inputs, self.input: self.rows(value)}

    @staticmethod
    def rows(value: Array) -> Array:
        """Each row of float32 `[rows, samples]` at zero mean and unit variance (a new array)."""
        mean = value.mean(axis=1, keepdims=True)
        variance = value.var(axis=1, keepdims=True)
        normalised: Array = (value - mean) / np.sqrt(variance + _EPSILON)
        return normalised


def open_audio_normalization(
    specs: Sequence[TensorSpec], folder: Path, mode: str, scanned: str | None = None
) -> AudioNormalization | None:
    """The normalisation `folder`'s feature extractor asks of a model of inputs `specs`
    served in `mode` (`scanned`: a scan's `[scan] input`); None where it asks none
    (ModelLoadError where its file is unreadable)."""
    spec = next((s for s in specs if s.name == AUDIO_INPUT), None)
    if spec is None or spec.dtype != _FLOAT32 or len(spec.shape) != 2 or mode not in MODES:
        return None
    extractor = read_json(folder / "preprocessor_config.json")
    kind = extractor.get("feature_extractor_type")
    if kind not in NORMALIZING_EXTRACTORS or extractor.get("do_normalize") is not True:
        return None
    per_window = mode == "scan" and scanned == AUDIO_INPUT
    rate = whole_number(extractor.get("sampling_rate"))
    return AudioNormalization(AUDIO_INPUT, per_window, rate)
