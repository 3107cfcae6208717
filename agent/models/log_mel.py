"""Whisper's input features: the log-mel spectrogram of `WhisperFeatureExtractor`.

A Whisper encoder reads `input_features [batch, mels, frames]`: the recording (16 kHz mono,
floats in [-1, 1]) padded with zeros, or cut, to `n_samples` (30 s), then a short-time Fourier
transform (a periodic Hann window of `n_fft`, `hop_length` apart, centred with reflected
edges), power, Slaney-normalised mel filters from 0 to 8 kHz, `log10` floored at 1e-10, the
last frame dropped, clamped to 8 below the maximum, and scaled as `(x + 4) / 4`. The version
folder's `preprocessor_config.json` (`feature_extractor_type: WhisperFeatureExtractor`) gives
the sizes; the filters are computed, as the extractor computes them (it does not save them).

Written here rather than imported: the extractor is numpy code inside `transformers`, whose
weight the agent does not take on for one function, and `librosa`'s filters differ in their
defaults. It is checked against `WhisperFeatureExtractor`'s own features for the fixture clips
(`tests/test_generate_whisper.py`). Imports only `backends.base` and `hf_files`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import ModelLoadError
from agent.models.hf_files import read_json, whole_number

__all__ = ["LogMel", "open_log_mel"]

EXTRACTOR = "WhisperFeatureExtractor"
_MEL_FLOOR = 1e-10
_MAX_FREQUENCY = 8000.0


@dataclass(frozen=True)
class LogMel:
    """One feature extractor's sizes, and its mel filters `[bins, mels]`."""

    mels: int
    n_fft: int
    hop: int
    samples: int  # the window the encoder reads (30 s)
    sample_rate: int
    filters: np.ndarray[Any, np.dtype[np.float64]]

    @classmethod
    def of(cls, mels: int, n_fft: int, hop: int, samples: int, sample_rate: int) -> LogMel:
        return cls(mels, n_fft, hop, samples, sample_rate, _mel_filters(n_fft, mels, sample_rate))

    @property
    def frames(self) -> int:
        """The frames of one window's features."""
        return self.samples // self.hop

    def features(self, samples: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """float32 `[1, mels, frames]` of float32 `samples [n]` (n at most `self.samples`).
        Frames past the recording's end hold only the padding's zeros: their power is 0 and
        their log the floor's, set without a transform (a 5 s recording transforms a sixth
        of the window's frames)."""
        waveform = np.zeros(self.samples, dtype=np.float64)
        waveform[: samples.size] = samples.astype(np.float32)  # the extractor's float32 first
        half = self.n_fft // 2
        padded = np.pad(waveform, (half, half), mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(padded, self.n_fft)[:: self.hop]
        heard = min(len(frames), -(-(samples.size + half) // self.hop))  # frames with a sample
        spectrum = np.fft.rfft(frames[:heard] * _hann(self.n_fft), axis=1).astype(np.complex64)
        power = np.abs(spectrum, dtype=np.float64) ** 2  # [frames, bins]
        mel = np.full((self.mels, len(frames)), _MEL_FLOOR)
        mel[:, :heard] = np.maximum(_MEL_FLOOR, self.filters.T @ power.T)  # [mels, frames]
        log_spec = np.log10(mel).astype(np.float32)[:, :-1]
        log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
        scaled: np.ndarray[Any, np.dtype[np.float32]] = ((log_spec + 4.0) / 4.0)[None]
        return scaled


def open_log_mel(folder: Path) -> LogMel | None:
    """The folder's Whisper feature extractor, or None where its `preprocessor_config.json`
    names another (ModelLoadError where it is unreadable or its sizes are not numbers)."""
    config = read_json(folder / "preprocessor_config.json")
    if config.get("feature_extractor_type") != EXTRACTOR:
        return None
    sizes = {
        key: whole_number(config.get(key))
        for key in ("feature_size", "n_fft", "hop_length", "n_samples", "sampling_rate")
    }
    missing = sorted(key for key, value in sizes.items() if value is None or value <= 0)
    if missing:
        raise ModelLoadError(f"preprocessor_config.json: {', '.join(missing)} not given")
    if config.get("do_normalize") is True or float(config.get("dither") or 0.0) != 0.0:
        raise ModelLoadError(
            "preprocessor_config.json: do_normalize and dither are not applied by the agent"
        )
    mels, n_fft, hop, samples, rate = (int(value or 0) for value in sizes.values())
    return LogMel.of(mels, n_fft, hop, samples, rate)


def _hann(length: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """A periodic Hann window."""
    window: np.ndarray[Any, np.dtype[np.float64]] = np.hanning(length + 1)[:-1]
    return window


def _mel_filters(n_fft: int, mels: int, rate: int) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Triangular Slaney filters `[1 + n_fft // 2, mels]` from 0 to 8 kHz, area-normalised."""
    edges = _mel_to_hertz(np.linspace(0.0, _hertz_to_mel(_MAX_FREQUENCY), mels + 2))
    bins = np.linspace(0, rate // 2, 1 + n_fft // 2)
    slopes = edges[None, :] - bins[:, None]
    widths = np.diff(edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    normalised: np.ndarray[Any, np.dtype[np.float64]] = filters * (2.0 / (edges[2:] - edges[:-2]))
    return normalised


_LOG_HERTZ, _LOG_MEL, _LOG_STEP = 1000.0, 15.0, np.log(6.4) / 27.0  # the Slaney scale


def _hertz_to_mel(hertz: float) -> float:
    if hertz >= _LOG_HERTZ:
        return float(_LOG_MEL + np.log(hertz / _LOG_HERTZ) / _LOG_STEP)
    return 3.0 * hertz / 200.0


def _mel_to_hertz(mel: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    linear = 200.0 * mel / 3.0
    logarithmic = _LOG_HERTZ * np.exp(_LOG_STEP * (mel - _LOG_MEL))
    hertz: np.ndarray[Any, np.dtype[np.float64]] = np.where(mel >= _LOG_MEL, logarithmic, linear)
    return hertz
