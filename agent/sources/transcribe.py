"""A pcm source through a speech recogniser: live audio transcribed one window at a time.

A generate model whose encoder reads log-mel features (Whisper: `Generation.log_mel`) takes a
pcm source too. The source's `window` samples (at most the feature extractor's 30 s) are cut
`hop` apart (default: the window, so no sample is heard twice), the last, partial window at the
source's end padded with silence (`tail = "pad"`); each runs as a generate request of its own
(`agent.inference.generate`, with the source's `params`: `language`, `task`,
`max_new_tokens`, ...), and is published as one message on `ROOT/stream/NAME`:
`outputs: {tokens}`, `text`, `finish_reason` and the window's `offset`.

With `previous_text` (the default) each window reads the text of the one before as its prompt
(`inputs.prompt`: Whisper's `prompt_ids`, as openai-whisper's `condition_on_previous_text`
feeds it), so words cut by a window's edge are heard in context; it starts empty at each
opening of the source, when a new version serves, and after a silent window. With
`silence_dbfs`, a window whose level (its RMS, in dB below full scale) is under it is not run
(a Whisper makes words up in silence): its message has no tokens, an empty `text` and
`silent: true`. One worker at a time runs a source's
windows (its ticket), so the text needs no lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.inference import speech
from agent.inference.generate import GenerateAsk, ask_of, generate
from agent.inference.modes import Member, Run
from agent.models.backends.base import Array
from agent.models.manager import LoadedVersion
from agent.protocol.errors import WireError
from agent.sources.base import SourceError
from agent.sources.readers.pcm import PcmRecord, WindowPlan

__all__ = ["Transcriber", "extractor_rate_problem", "speech_window_plan"]


def speech_window_plan(config: SourceConfig, loaded: LoadedVersion) -> WindowPlan:
    """How the source feeds a speech recogniser; SourceError naming what does not fit."""
    generation = loaded.generation
    name = f"model '{config.model}'"
    if generation is None or generation.log_mel is None:
        raise SourceError(
            f"{name} is a generate model that reads no recording: a pcm source feeds scan "
            "models and speech recognisers (an encoder of input_features, as Whisper's)"
        )
    log_mel = generation.log_mel
    if config.window is None or not config.window <= log_mel.samples:
        raise SourceError(
            f"{name} transcribes windows of the source's window = N samples, 1 to "
            f"{log_mel.samples} ({log_mel.samples / log_mel.sample_rate:g} s)"
        )
    if config.channels != 1 or config.windows_per_chunk not in (None, 1):
        raise SourceError(f"{name} transcribes mono windows, one a message")
    problem = extractor_rate_problem(config, log_mel.sample_rate)
    if problem is not None:
        raise SourceError(problem)
    silence = np.zeros(config.window, np.float32)
    try:  # the params every window will be asked with, checked once
        ask_of(speech.window_inputs(silence, "", generation), config.params or {}, generation)
    except WireError as e:
        raise SourceError(f"params: {e.message}") from None
    window = config.window
    return WindowPlan(speech.SAMPLES, window, config.hop or window, 0, "pad", 1, mono_rank1=True)


def extractor_rate_problem(config: SourceConfig, rate: int | None) -> str | None:
    """A speech encoder's feature extractor says the rate it was trained at
    (`preprocessor_config.json`'s `sampling_rate`, `rate`): the source's must be it."""
    if rate is None or rate == config.sample_rate:
        return None
    return (
        f"sample_rate = {config.sample_rate} does not match model '{config.model}' (its "
        f"preprocessor_config.json: sampling_rate {rate}): record at {rate} Hz or resample "
        "in the command"
    )


class Transcriber:
    """A pcm source's windows through a speech recogniser, the previous window's text kept."""

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self.previous = ""
        self.version: int | None = None

    def run(
        self, loaded: LoadedVersion, record: PcmRecord, chunk: int = 0
    ) -> tuple[dict[str, Array], dict[str, Any]]:
        """The chunk's window transcribed: its outputs, and the message's `text` and
        `finish_reason`. WireError where the window is refused (bad samples)."""
        generation = loaded.generation
        assert generation is not None  # `speech_window_plan` checked it at the opening
        if (record.fresh and chunk == 0) or loaded.version != self.version:
            self.previous, self.version = "", loaded.version
        window = record.windows(chunk)[0]
        if self._silent(window):
            self.previous = ""
            empty = np.zeros(0, dtype=np.int64)
            return {"tokens": empty}, {"finish_reason": None, "text": "", "silent": True}
        previous = self.previous if self.config.previous_text is not False else ""
        inputs = speech.window_inputs(window, previous, generation)
        ask = ask_of(inputs, self.config.params or {}, generation)
        _transcribed(loaded, ask)
        text = ask.text.sent if ask.text is not None else None  # the stream's, all of it
        self.previous = text.strip() if text is not None else ""
        extra: dict[str, Any] = {"finish_reason": ask.finish_reason}
        language = ask.ending().get("language")
        if language is not None:
            extra["language"] = language
        if text is not None:
            extra["text"] = text
        return ask.outputs(), extra

    def _silent(self, window: np.ndarray[Any, Any]) -> bool:
        """Whether the window is quieter than `silence_dbfs` (never, without one)."""
        floor = self.config.silence_dbfs
        if floor is None:
            return False
        rms = float(np.sqrt(np.mean(np.square(window, dtype=np.float64))))
        return rms <= 0.0 or 20.0 * np.log10(rms) < floor


def _transcribed(loaded: LoadedVersion, ask: GenerateAsk) -> None:
    """`ask` generated to its end (its tokens and finish reason filled in)."""
    run = Run(loaded.session, loaded.config.stream, [Member({}, 1, generation=ask)])
    for _ in generate(run):
        pass
