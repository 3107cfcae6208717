"""A generate request checked: its prompt, limits, sampling, search and stop strings.

:func:`ask_of` turns a request's inputs and params into a :class:`GenerateAsk` against the
version's `Generation` (`bad_request` for what it cannot take): the prompt's ids from
`input_ids`, a text (`prompt`, through the tokenizer), a conversation (`messages`, through the
chat template) or a recording (a speech recogniser's: `agent.inference.speech`); the room the
context leaves; `max_new_tokens`, `tokens_per_chunk`, the stop strings, the sampler, the
number of beams and prompt lookup's guesses. The strategy that runs it is
`agent.inference.generate`'s (which applies the configs' token rules).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.inference import modes, pictures, speech
from agent.inference.modes import Arrays
from agent.inference.sampling import Sampler, SamplingParams
from agent.inference.text_stream import TextStream
from agent.models.chat_template import ChatRefused
from agent.models.decoder_layout import Generation
from agent.models.generate_config import MAX_LOOKUP
from agent.models.token_settings import MAX_BEAMS
from agent.models.tokenizer import too_long
from agent.protocol.errors import WireError

__all__ = ["AskedParams", "GenerateAsk", "Recording", "ask_of", "params_of"]

MAX_STOPS = 16
MAX_MESSAGES = 256  # rows of a conversation (`inputs.messages`)
MAX_STOP_CHARS = 256
MAX_TOKENS_PER_CHUNK = 4096


@dataclass
class Recording:
    """What is left of a long recording after the window a generation reads, and the
    request's params, which every window is asked with."""

    rest: np.ndarray[Any, Any]
    params: dict[str, Any]


@dataclass
class GenerateAsk:
    """One request's generation: what it asked, and (filled by the strategy) how it went."""

    setup: Generation
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    tokens_per_chunk: int = 1
    text: TextStream | None = None
    # A speech or image encoder's input (log-mel features, pixel values): the prompt is then
    # the decoder's, its detected language still to go in at `language_at`, where a
    # Whisper's is to be detected.
    encoder_input: np.ndarray[Any, Any] | None = None
    language_at: int | None = None
    beams: int = 1  # above 1: beam search (`agent.inference.beam`)
    lookup: int = 0  # above 0: tokens guessed a run (`agent.inference.prompt_lookup`)
    # A speech recogniser's recording longer than its encoder's window: the samples after
    # the first window, transcribed window after window (`agent.inference.generate`).
    recording: Recording | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None  # monotonic
    cached_tokens: int = 0  # the prompt's first tokens the prefix cache held (not run again)

    @property
    def usage(self) -> dict[str, int]:
        usage = {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens)}
        if self.cached_tokens:
            usage["cached_tokens"] = self.cached_tokens
        return usage

    @property
    def decoder_ids(self) -> list[int]:
        """What the decoder reads before its first new token: the prompt, or an
        encoder-decoder's start token (its prompt goes to the encoder)."""
        start = self.setup.decoder_start
        return self.prompt if start is None or self.encoder_input is not None else [start]

    def ending(self) -> dict[str, Any]:
        """The keys of the stream's terminal message (a Whisper's: the language it heard in,
        asked or detected)."""
        keys: dict[str, Any] = {"finish_reason": self.finish_reason, "usage": self.usage}
        speech = self.setup.speech
        language = speech.language_in(self.prompt) if speech is not None else None
        if language is not None:
            keys["language"] = language
        return keys

    def outputs(self) -> Arrays:
        """`stream: false`: the result's outputs, every new token in one tensor."""
        return {"tokens": np.array(self.tokens, dtype=np.int64)}


@dataclass(frozen=True)
class AskedParams:
    """A generate request's params, checked (`params_of`)."""

    max_new_tokens: int | None  # None: as many as the room allows
    tokens_per_chunk: int
    stops: list[str]
    sampling: SamplingParams
    beams: int
    lookup: int


def params_of(params: Mapping[str, Any], setup: Generation) -> AskedParams:
    """A generate request's params checked against `setup` (`bad_request`): all but those a
    prompt needs (a Whisper's language and task). Also run at arrival, so that a request
    with bad params never takes a queue slot (`agent.service.ingress`)."""
    if setup.log_mel is None:  # a speech recogniser's are read with its prompt
        speech.refuse_prompt_params(params)
    asked = params.get("max_new_tokens")
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise WireError("bad_request", "params.max_new_tokens must be a positive integer")
    per_chunk = modes.integer_param(params, "tokens_per_chunk", 1, low=1, high=MAX_TOKENS_PER_CHUNK)
    stops = _stops(params)
    if stops and setup.tokenizer is None:
        raise WireError("bad_request", "params.stop needs a model with a tokenizer.json")
    sampling = SamplingParams.parse(params, setup.token_settings.repetition_penalty)
    sampled = sampling.temperature > 0
    beams = _beams(params, setup, sampled, bool(stops))
    lookup = _lookup(params, setup, sampled or beams > 1)
    return AskedParams(asked, per_chunk, stops, sampling, beams, lookup)


def ask_of(inputs: Mapping[str, Any], params: Mapping[str, Any], setup: Generation) -> GenerateAsk:
    """A request's inputs and params checked against a generate version (`bad_request`)."""
    tokenizer = setup.tokenizer
    asked = params_of(params, setup)
    encoder_input, language_at, rest = None, None, None
    if setup.log_mel is not None:
        encoder_input, rest = speech.features_of(inputs, setup.log_mel)
        prompt, language_at = speech.prompt_of(inputs, params, setup)
    elif setup.image is not None and setup.decoder_start is not None:
        encoder_input = pictures.pixels_of(inputs, setup.image)
        prompt = [setup.decoder_start]
    else:
        prompt = _prompt_ids(inputs, setup)
    room = setup.max_new_tokens
    if setup.context is not None and setup.encoder is not None and encoder_input is None:
        if len(prompt) > setup.context:  # the encoder's positions; the decoder's own
            raise WireError(
                "bad_request",
                f"the prompt is {len(prompt)} tokens: the encoder takes at most {setup.context}",
            )
        room = min(room, setup.context - 1)  # the decoder's positions, its start token's first
    elif setup.context is not None:
        length = len(prompt) + (language_at is not None)  # a detected language joins it
        if length >= setup.context:
            raise WireError(
                "bad_request",
                f"the prompt is {length} tokens: the model's context is {setup.context}, "
                "with room for at least one new token",
            )
        room = min(room, setup.context - length)
    stops = asked.stops
    text = TextStream(tokenizer, stops) if tokenizer is not None else None
    limit = room if asked.max_new_tokens is None else min(asked.max_new_tokens, room)
    ask = GenerateAsk(setup, prompt, limit, Sampler(asked.sampling), asked.tokens_per_chunk, text)
    ask.encoder_input, ask.language_at = encoder_input, language_at
    ask.beams, ask.lookup = asked.beams, asked.lookup
    if rest is not None:  # a recording longer than the encoder's window: one after another
        if stops:
            raise WireError(
                "bad_request", "params.stop is not taken with a recording longer than 30 s"
            )
        ask.recording = Recording(rest, dict(params))
    return ask


def _beams(params: Mapping[str, Any], setup: Generation, sampling: bool, stops: bool) -> int:
    """`params.num_beams`, else the model's `num_beams` where the request does not sample
    (`generate` would sample the beams: the agent samples one sequence) and its decoder
    has a cache; `bad_request` for beams asked with sampling, stop strings or no cache."""
    asked = "num_beams" in params
    beams = modes.integer_param(params, "num_beams", 1, low=1, high=MAX_BEAMS)
    if not asked:
        plain = sampling or stops or not setup.layout.cache
        return 1 if plain else setup.token_settings.num_beams
    if beams > 1 and (sampling or stops or not setup.layout.cache):
        raise WireError(
            "bad_request",
            "params.num_beams > 1 is a greedy search: not with params.temperature or "
            "params.stop, nor for a decoder exported without its cache",
        )
    return beams


def _lookup(params: Mapping[str, Any], setup: Generation, not_greedy: bool) -> int:
    """`params.prompt_lookup`, else the model's `[generate] prompt_lookup` where it can apply:
    a greedy search of one sequence by a decoder alone whose cache can be cut
    (`Generation.cuttable`); `bad_request` where it is asked and cannot."""
    fits = setup.cuttable
    if "prompt_lookup" not in params:
        return setup.prompt_lookup if fits and not not_greedy else 0
    lookup = modes.integer_param(params, "prompt_lookup", 0, high=MAX_LOOKUP)
    if lookup and not_greedy:
        raise WireError(
            "bad_request",
            "params.prompt_lookup is a greedy search of one sequence: not with "
            "params.temperature or params.num_beams",
        )
    if lookup and not fits:
        raise WireError(
            "bad_request",
            "params.prompt_lookup needs a decoder alone with its cache, on the host or on "
            "ONNX Runtime's GPU provider (not TensorRT)",
        )
    return lookup


def _prompt_ids(inputs: Mapping[str, Any], setup: Generation) -> list[int]:
    names = sorted(inputs)
    if names == ["prompt"]:
        if setup.tokenizer is None:
            raise WireError("bad_request", "inputs.prompt needs a model with a tokenizer.json")
        text = modes.one_text(inputs["prompt"], "prompt")
        if not isinstance(text, str):
            raise WireError("bad_request", "inputs.prompt must be one text")
        _refuse_long(text, setup, "inputs.prompt")
        ids = setup.tokenizer.encode(text)
    elif names == ["messages"]:
        ids = _chat_ids(inputs["messages"], setup)
    elif names == ["input_ids"]:
        value = inputs["input_ids"]
        if not (isinstance(value, np.ndarray) and value.dtype.kind in "iu"):
            raise WireError("bad_request", "inputs.input_ids must be an integer tensor")
        if value.ndim == 2 and value.shape[0] == 1:
            value = value[0]
        if value.ndim != 1:
            raise WireError("bad_request", "inputs.input_ids must be [T] or [1, T]")
        ids = [int(t) for t in value]
    else:
        takes = "inputs.input_ids"
        if setup.tokenizer is not None:
            takes = "inputs.prompt (text) or " + takes
        if setup.chat is not None:
            takes = "inputs.messages (a conversation), " + takes
        raise WireError("bad_request", f"a generate request takes {takes}, nothing else")
    if not ids:
        raise WireError("bad_request", "the prompt is empty")
    vocab = setup.vocab
    if vocab is not None and not all(0 <= t < vocab for t in ids):
        raise WireError("bad_request", f"input_ids must be token ids from 0 to {vocab - 1}")
    return ids


def _chat_ids(value: Any, setup: Generation) -> list[int]:
    """The prompt of a conversation, `inputs.messages`: a string tensor of (role, content)
    rows, laid out by the model's chat template and tokenized without added special tokens."""
    chat, tokenizer = setup.chat, setup.tokenizer
    if chat is None or tokenizer is None:
        raise WireError(
            "bad_request",
            "inputs.messages needs a model with a chat template (chat_template.jinja, or "
            "tokenizer_config.json's chat_template) beside its tokenizer.json",
        )
    shape_ok = isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] == 2
    if not (shape_ok and value.dtype.kind in "OU" and 1 <= value.shape[0] <= MAX_MESSAGES):
        raise WireError(
            "bad_request",
            f"inputs.messages must be a string tensor [n, 2] of (role, content) rows, "
            f"1 to {MAX_MESSAGES}",
        )
    rows = value.tolist()
    if not all(isinstance(text, str) for row in rows for text in row):
        raise WireError("bad_request", "inputs.messages must hold texts")
    try:
        prompt = chat.render([{"role": role, "content": content} for role, content in rows])
    except ChatRefused as e:
        raise WireError("bad_request", str(e)) from None
    _refuse_long(prompt, setup, "the conversation laid out")
    return tokenizer.encode(prompt, special=False)


def _refuse_long(text: str, setup: Generation, what: str) -> None:
    """`bad_request` for a text that cannot fit the context, before it is tokenized."""
    problem = too_long(text, setup.context)
    if problem is not None:
        raise WireError("bad_request", f"{what} {problem}")


def _stops(params: Mapping[str, Any]) -> list[str]:
    stops = params.get("stop", [])
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise WireError(
            "bad_request",
            f"params.stop must be an array of at most {MAX_STOPS} texts of 1 to "
            f"{MAX_STOP_CHARS} characters",
        )
    return list(stops)
