"""A Whisper request of `mode = "generate"`: its recording, its prompt, its language.

A speech recogniser's generate request (`Generation.log_mel`: an encoder of log-mel features
beside the decoder) sends its recording, `inputs.input_values` (float samples `[n]` or
`[1, n]` at the feature extractor's rate, at most its window: 30 s), or the features
themselves, `inputs.input_features` (`[1, mels, frames]`, as `WhisperFeatureExtractor`
makes them). `params.language` (`"en"` or `"<|en|>"`) and `params.task` (`"transcribe"`,
`"translate"`) choose the decoder's prompt (`agent.models.speech_prompt`); where neither the
request nor the config names a language, the model's own likeliest language token after the
start token is taken, as `WhisperForConditionalGeneration.detect_language` takes it: one
decoder run before the prefill. `inputs.prompt` (a text: the transcript of the previous piece
of a long recording, or words to expect) goes before that prompt, as `generate`'s `prompt_ids`
made by `WhisperProcessor.get_prompt_ids`: `<|startofprev|>`, then the text stripped with one
leading space.

Imports `modes`, the protocol's errors and `agent.models`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.inference.modes import Arrays, Run, one_text
from agent.models.audio_inputs import AUDIO_INPUT
from agent.models.decoder_layout import Generation
from agent.models.encoders import FEATURES
from agent.models.log_mel import LogMel
from agent.models.speech_prompt import PromptRefused
from agent.models.text_inputs import TEXT_INPUT
from agent.protocol.errors import WireError

if TYPE_CHECKING:
    from agent.inference.generate_ask import GenerateAsk

__all__ = ["detect_language", "features_of", "prompt_of", "refuse_prompt_params", "tail"]

SAMPLES = AUDIO_INPUT  # what a request names its recording (as wav2vec2's input is named)
PREVIOUS_TEXT = TEXT_INPUT  # the text the decoder reads before its prompt of special tokens
PREVIOUS_TOKEN = "<|startofprev|>"
MAX_PREVIOUS_CHARS = 4096
DEFAULT_CONTEXT = 448  # Whisper's max_target_positions, where the version names none


def features_of(
    inputs: Mapping[str, Any], log_mel: LogMel
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    """The encoder's features of a request's recording (its first window's, and the samples
    after that window where it is longer: `agent.inference.recording`), or the features it
    sent (`bad_request` where they are neither)."""
    names = sorted(set(inputs) - {PREVIOUS_TEXT})
    if names == [FEATURES]:
        value = inputs[FEATURES]
        shape = (1, log_mel.mels, log_mel.frames)
        if not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.shape == shape):
            raise WireError("bad_request", f"inputs.{FEATURES} must be floats {list(shape)}")
        return _finite(value.astype(np.float32, copy=False), FEATURES), None
    if names != [SAMPLES]:
        raise WireError(
            "bad_request",
            f"a speech request takes inputs.{SAMPLES} (float samples [n] at "
            f"{log_mel.sample_rate} Hz) or inputs.{FEATURES}, and inputs.{PREVIOUS_TEXT} (the "
            "previous text), nothing else",
        )
    value = inputs[SAMPLES]
    if isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[0] == 1:
        value = value[0]
    if not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.ndim == 1):
        raise WireError("bad_request", f"inputs.{SAMPLES} must be float samples [n] or [1, n]")
    if value.size == 0:
        raise WireError("bad_request", f"inputs.{SAMPLES} holds no samples")
    value = _finite(value, SAMPLES)
    rest = value[log_mel.samples :] if value.size > log_mel.samples else None
    return log_mel.features(value[: log_mel.samples]), rest


def prompt_of(
    inputs: Mapping[str, Any], params: Mapping[str, Any], setup: Generation
) -> tuple[list[int], int | None]:
    """The decoder's prompt for `inputs.prompt`, `params.language` and `params.task`, and
    where its detected language goes, if one is to be detected (then left out of the list:
    `detect_language` puts it in)."""
    language, task = params.get("language"), params.get("task")
    for name, value in (("language", language), ("task", task)):
        if value is not None and not (isinstance(value, str) and 0 < len(value) <= 32):
            raise WireError("bad_request", f"params.{name} must be a text")
    previous = _previous_ids(inputs, setup)
    if setup.speech is None:
        refuse_prompt_params(params)
        assert setup.decoder_start is not None  # an encoder-decoder's (`open_generation`)
        return [*previous, setup.decoder_start], None
    try:
        ids = setup.speech.ids(language, task)
    except PromptRefused as e:
        raise WireError("bad_request", str(e)) from None
    language_at = len(previous) + 1 if setup.speech.detects(ids) else None
    return [*previous, *(i for i in ids if i is not None)], language_at


def _previous_ids(inputs: Mapping[str, Any], setup: Generation) -> list[int]:
    """`inputs.prompt`'s ids as `get_prompt_ids` makes them (none without one)."""
    if PREVIOUS_TEXT not in inputs:
        return []
    text = one_text(inputs[PREVIOUS_TEXT], PREVIOUS_TEXT)
    if not isinstance(text, str) or len(text) > MAX_PREVIOUS_CHARS:
        raise WireError(
            "bad_request",
            f"inputs.{PREVIOUS_TEXT} must be a text of {MAX_PREVIOUS_CHARS} characters at most",
        )
    tokenizer = setup.tokenizer
    start = tokenizer.token_id(PREVIOUS_TOKEN) if tokenizer is not None else None
    if tokenizer is None or start is None:
        raise WireError(
            "bad_request",
            f"inputs.{PREVIOUS_TEXT} needs a tokenizer.json with a {PREVIOUS_TOKEN} token",
        )
    ids = tokenizer.encode(" " + text.strip(), special=False)
    if set(ids) & tokenizer.special_ids():
        raise WireError(
            "bad_request", f"inputs.{PREVIOUS_TEXT} holds a special token's text (<|...|>)"
        )
    return [start, *ids]


def tail(previous: str, setup: Generation) -> str:
    """The end of a previous window's text that the next window's prompt holds: at most as
    many tokens as `generate`'s long-form keeps of it (half the context, less one), so that
    it always leaves room; as many characters first, fewer where they make more tokens (a
    character of several bytes can be several byte-level tokens)."""
    keep = max(1, (setup.context or DEFAULT_CONTEXT) // 2 - 1)
    text, tokenizer = previous[-keep:], setup.tokenizer
    while tokenizer is not None and len(tokenizer.encode(" " + text, special=False)) > keep:
        text = text[len(text) // 4 + 1 :]
    return text


def window_inputs(samples: np.ndarray[Any, Any], previous: str, setup: Generation) -> Arrays:
    """A window's request inputs: its samples, and the previous window's text (its `tail`)
    as the decoder's prompt where there is one."""
    inputs: Arrays = {SAMPLES: samples}
    if previous:
        inputs[PREVIOUS_TEXT] = np.array(tail(previous, setup), dtype=object)
    return inputs


def refuse_prompt_params(params: Mapping[str, Any]) -> None:
    """`bad_request` for `params.language` or `params.task` sent to a model whose prompt
    they do not choose."""
    if "language" in params or "task" in params:
        raise WireError("bad_request", "the model takes no params.language nor params.task")


def detect_language(run: Run, ask: GenerateAsk, first: Arrays) -> Arrays:
    """The language the model finds likeliest after its start token (`first`: the decoder's
    inputs for that token alone, with the encoder's), put in `ask.prompt` where it goes; the
    run's outputs (its cache: the start token's, which the prompt begins with where no
    previous text comes before it)."""
    setup = ask.setup
    assert setup.speech is not None and ask.language_at is not None  # `prompt_of` asked
    outputs = run.model(first, setup.device_cache)
    logits = outputs[setup.layout.logits]
    languages = setup.speech.language_ids
    row = logits[0, -1]
    ask.prompt.insert(ask.language_at, int(languages[np.argmax(row[languages])]))
    ask.language_at = None
    return outputs


def _finite(value: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
    if not np.isfinite(value).all():
        raise WireError("bad_request", f"inputs.{name} holds NaN or infinite values")
    return value
