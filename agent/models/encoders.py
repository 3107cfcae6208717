"""An encoder-decoder's encoder (`encoder_model.onnx` beside the decoder): what it reads.

optimum exports an encoder-decoder as two files; the decoder is the version's `model.onnx`
(`agent.models.decoder_layout`) and its encoder `encoder_model.onnx`, opened on the same
backend and run once a request before the decoder's first run. What the encoder's signature
takes says what the request sends:

- `input_ids` (and `attention_mask`): a text encoder (T5, BART, Marian): the prompt's ids;
- `input_features [batch, mels, frames]`: a speech encoder (Whisper): a recording, made into
  log-mel features as the folder's `WhisperFeatureExtractor` makes them
  (`agent.models.log_mel`), the decoder's prompt laid out by `agent.models.speech_prompt`;
- `pixel_values [batch, 3, height, width]`: an image encoder (a `VisionEncoderDecoderModel`:
  TrOCR, ViT-GPT2 captioners; optimum's `image-to-text-with-past`): a picture, made into pixel
  values as the folder's image processor makes them (`agent.models.image_processor`).

Imports only `backends.base`, `hf_files`, `log_mel`, `speech_prompt`, `image_processor` and
`preprocess`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import ModelLoadError, Session
from agent.models.image_processor import processor_preprocess
from agent.models.log_mel import open_log_mel
from agent.models.speech_prompt import speech_prompt_of

__all__ = ["ENCODER_FILE", "FEATURES", "PIXELS", "Encoder", "encoder_reads"]

ENCODER_FILE = "encoder_model.onnx"  # optimum's name for an encoder-decoder's encoder
FEATURES = "input_features"  # a speech encoder's input (Whisper's log-mel spectrogram)
PIXELS = "pixel_values"  # an image encoder's input
# What each kind of encoder takes: its first input, the dtype kinds it may have, the others.
_KINDS = {
    "text": ("input_ids", "iu", {"input_ids", "attention_mask"}),
    "speech": (FEATURES, "f", {FEATURES}),
    "image": (PIXELS, "f", {PIXELS}),
}


class Encoder:
    """An encoder-decoder's encoder: its session, the kind of input it reads (`kind`: "text",
    "speech" or "image"; see the module docstring), its last hidden states out."""

    def __init__(self, session: Session) -> None:
        ins = {spec.name: spec for spec in session.inputs}
        self.kind = "speech" if FEATURES in ins else "image" if PIXELS in ins else "text"
        first, kinds, taken = _KINDS[self.kind]
        if first not in ins or np.dtype(ins[first].dtype).kind not in kinds:
            number = "integer" if self.kind == "text" else "float"
            raise ModelLoadError(f"{ENCODER_FILE}: no {number} {first}")
        unknown = sorted(set(ins) - taken)
        if unknown or not session.outputs:
            raise ModelLoadError(
                f"{ENCODER_FILE}: inputs {', '.join(sorted(ins))} and no more than "
                f"{' and '.join(sorted(taken))} are an encoder's"
            )
        self.session = session
        self.input = ins[first]
        mask = ins.get("attention_mask")
        self._mask = np.dtype(mask.dtype) if mask is not None else None
        names = [spec.name for spec in session.outputs]
        self.output = "last_hidden_state" if "last_hidden_state" in names else names[0]

    def inputs(self, ids: Sequence[int]) -> dict[str, Any]:
        """A text encoder's inputs for one prompt."""
        made: dict[str, Any] = {"input_ids": np.array([ids], dtype=self.input.dtype)}
        if self._mask is not None:
            made["attention_mask"] = np.ones((1, len(ids)), dtype=self._mask)
        return made

    def warm_up(self, inputs: dict[str, Any]) -> str | None:
        """One run on `inputs` at load, so that the first request does not pay the
        runtime's first allocations; why it failed, else None (the version still serves: the
        decoder's warm-up is the one that counts)."""
        try:
            self.session.run(inputs)
        except Exception as e:  # the backend's own error types: a guessed input, not the model
            return str(e)
        return None

    def close(self) -> None:
        self.session.close()


def encoder_reads(
    encoder: Encoder, folder: Path, configs: tuple[dict[str, Any], dict[str, Any]], start: int
) -> dict[str, Any]:
    """The `Generation` fields of what a speech or image encoder reads (`log_mel` and
    `speech`, a Whisper's prompt after the decoder's `start` token, or `image`); none for a
    text encoder. ModelLoadError where the folder's
    preprocessor is not one the agent applies, or its sizes are not the encoder's."""
    if encoder.kind == "speech":
        return _speech_of(encoder, folder, configs, start)
    if encoder.kind == "image":
        image = processor_preprocess([encoder.input], folder)
        if image is None:
            raise ModelLoadError(
                f"the encoder takes {PIXELS}: its folder needs the preprocessor_config.json "
                "of an image processor the agent applies (a {height, width} resize, rescale, "
                "normalise)"
            )
        return {"image": image}
    return {}


def _speech_of(
    encoder: Encoder, folder: Path, configs: tuple[dict[str, Any], dict[str, Any]], start: int
) -> dict[str, Any]:
    """A speech encoder's feature extractor and prompt rules (`Generation.log_mel`,
    `Generation.speech`); ModelLoadError where the folder's extractor is not one the agent
    computes, or its sizes are not the encoder's."""
    log_mel = open_log_mel(folder)
    if log_mel is None:
        raise ModelLoadError(
            f"the encoder takes {FEATURES}: its folder needs the preprocessor_config.json of a "
            "WhisperFeatureExtractor"
        )
    shape = encoder.input.shape
    if len(shape) != 3 or shape[1:] != (log_mel.mels, log_mel.frames):
        raise ModelLoadError(
            f"{ENCODER_FILE}: {FEATURES} {encoder.input.describe()} is not [batch, "
            f"{log_mel.mels}, {log_mel.frames}] as preprocessor_config.json makes them"
        )
    return {"log_mel": log_mel, "speech": speech_prompt_of(configs, start)}
