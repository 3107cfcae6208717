"""`mode = "generate"`: token streaming from an exported decoder (the strategy of the runner).

A request is checked into a :class:`GenerateAsk` (prompt ids, limits, sampling, stop strings)
by :func:`ask_of`; the strategy :func:`generate` (registered in
`agent.inference.modes.STRATEGIES`) then runs each member as Hugging Face's `generate` does:
a prefill of the whole prompt with an empty past (past length 0), then one run per new token
with the past taken from `present.*`, the attention mask and positions grown by one. The token
is chosen outside the graph (`agent.inference.sampling`); the generation ends at an eos token
(`eos`), at `max_new_tokens` (`length`), at a stop string (`stop`) or when `ROOT/cancel` asked
(`cancelled`). Every `tokens_per_chunk` tokens are one piece, `outputs: {tokens: int64 [k]}`
and, with a tokenizer, the piece's `text` (`agent.inference.text_stream`).

An encoder-decoder (`Generation.encoder`) runs its encoder once on the prompt first; the
decoder then starts from its start token, takes the encoder's states at every run, and feeds
the cross-attention's cache of its first run unchanged to the others (`CacheSlot.fixed`).
A speech recogniser's encoder reads the request's recording as log-mel features, and its
decoder starts from a prompt of language and task tokens (`agent.inference.speech`). What the
model's configs force or bar at each token is `agent.inference.token_rules`'.

Members of one run (requests queued together, where the model has `[batching]`) run their
prefills one by one, then every later step together, a row each
(`agent.inference.generate_lockstep`); a layout without the mask or explicit positions, which
left padding needs, has them interleave, a run each in turn. On the CPU the cache stays what
the session returns (numpy, fed back as it is, without a copy; ONNX Runtime's `OrtValue`s
through `run_with_ort_values` measured slower there, the wrapping of each small input costing
more than it saves); on a GPU provider it stays on the device (`Generation.device_cache`).
A step allocates nothing of its own but the token list: the mask is a view, the token and its
position are written into arrays made once, greedy takes the arg max of the logits row as it
is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.inference import modes, speech
from agent.inference.generate_lockstep import LockstepBatch
from agent.inference.job import Cancelled
from agent.inference.modes import Arrays, Piece, Run
from agent.inference.sampling import Sampler, SamplingParams
from agent.inference.text_stream import TextStream
from agent.inference.token_rules import TokenRules
from agent.models.backends.base import InferenceError
from agent.models.chat_template import ChatRefused
from agent.models.decoder_layout import DecoderLayout, Generation
from agent.models.tokenizer import too_long
from agent.protocol.errors import WireError

__all__ = ["GenerateAsk", "ask_of", "generate"]

MAX_STOPS = 16
MAX_MESSAGES = 256  # rows of a conversation (`inputs.messages`)
MAX_STOP_CHARS = 256
MAX_TOKENS_PER_CHUNK = 4096
_USE_CACHE = np.ones((1,), dtype=np.bool_)  # `use_cache_branch` after the prefill


@dataclass
class GenerateAsk:
    """One request's generation: what it asked, and (filled by the strategy) how it went."""

    setup: Generation
    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    tokens_per_chunk: int = 1
    text: TextStream | None = None
    # A speech encoder's input (Whisper's log-mel features): the prompt is then the decoder's,
    # its detected language still to go in at `language_at`, where one is to be detected.
    features: np.ndarray[Any, Any] | None = None
    language_at: int | None = None
    rules: TokenRules | None = None  # what the configs impose (made by `ask_of`)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token_at: float | None = None  # monotonic

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens)}

    @property
    def decoder_ids(self) -> list[int]:
        """What the decoder reads before its first new token: the prompt, or an
        encoder-decoder's start token (its prompt goes to the encoder)."""
        start = self.setup.decoder_start
        return self.prompt if start is None or self.features is not None else [start]

    def ending(self) -> dict[str, Any]:
        """The keys of the stream's terminal message."""
        return {"finish_reason": self.finish_reason, "usage": self.usage}

    def outputs(self) -> Arrays:
        """`stream: false`: the result's outputs, every new token in one tensor."""
        return {"tokens": np.array(self.tokens, dtype=np.int64)}


def ask_of(inputs: Mapping[str, Any], params: Mapping[str, Any], setup: Generation) -> GenerateAsk:
    """A request's inputs and params checked against a generate version (`bad_request`)."""
    tokenizer = setup.tokenizer
    features, language_at = None, None
    if setup.log_mel is not None:
        features = speech.features_of(inputs, setup.log_mel)
        prompt, language_at = speech.prompt_of(inputs, params, setup)
    else:
        speech.refuse_prompt_params(params)
        prompt = _prompt_ids(inputs, setup)
    room = setup.max_new_tokens
    if setup.context is not None and setup.encoder is not None and features is None:
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
    asked = params.get("max_new_tokens", room)
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
        raise WireError("bad_request", "params.max_new_tokens must be a positive integer")
    per_chunk = modes.integer_param(params, "tokens_per_chunk", 1, low=1, high=MAX_TOKENS_PER_CHUNK)
    stops = _stops(params)
    if stops and tokenizer is None:
        raise WireError("bad_request", "params.stop needs a model with a tokenizer.json")
    text = TextStream(tokenizer, stops) if tokenizer is not None else None
    settings = setup.token_settings
    sampler = Sampler(SamplingParams.parse(params, settings.repetition_penalty))
    ask = GenerateAsk(setup, prompt, min(asked, room), sampler, per_chunk, text)
    ask.features, ask.language_at = features, language_at
    ask.rules = TokenRules(settings, setup.eos, ask.max_new_tokens)
    return ask


def _prompt_ids(inputs: Mapping[str, Any], setup: Generation) -> list[int]:
    names = sorted(inputs)
    if names == ["prompt"]:
        if setup.tokenizer is None:
            raise WireError("bad_request", "inputs.prompt needs a model with a tokenizer.json")
        value = inputs["prompt"]
        if not (isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "OU"):
            raise WireError("bad_request", "inputs.prompt must be one text")
        text = value.reshape(()).item()
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


# -- the strategy -----------------------------------------------------------------------------


class _Decoding:
    """One member's loop state: the next run's inputs, the tokens and text not yet sent, and
    the step inputs made once (the mask a view of one row of ones as long as the generation
    can grow; the new token and its position written in place before each run)."""

    def __init__(self, ask: GenerateAsk, run: Run) -> None:
        self.ask = ask
        # An encoder-decoder's decoder inputs of its encoder's run, and its cross-attention
        # cache once the first run made it: the same at every run.
        self.cross = _encoded(run, ask)
        if ask.language_at is not None and ask.setup.speech is not None:
            first = _sequence_inputs(ask.setup.layout, [ask.setup.speech.start])
            speech.detect_language(run, ask, {**first, **self.cross})
        self.inputs = {**_prefill_inputs(ask), **self.cross}
        self.pending: list[int] = []  # new tokens not yet in a piece (the last of ask.tokens)
        self.pending_text = ""
        layout = ask.setup.layout
        self.token = np.zeros((1, 1), dtype=layout.int_dtypes[layout.input_ids])
        self.position: np.ndarray[Any, Any] | None = None
        self.mask: np.ndarray[Any, Any] | None = None
        if layout.position_ids is not None:
            self.position = np.zeros((1, 1), dtype=layout.int_dtypes[layout.position_ids])
        if layout.attention_mask is not None:
            longest = len(ask.prompt) + ask.max_new_tokens
            self.mask = np.ones((1, longest), dtype=layout.int_dtypes[layout.attention_mask])
        ask.sampler.see(ask.decoder_ids)  # as `generate` sees the decoder's input_ids
        _rules(ask).start(ask.decoder_ids)


def generate(run: Run) -> Iterator[list[Piece]]:
    states = {p: _Decoding(_ask(run, p), run) for p in range(len(run.members))}
    lockstep = len(states) > 1 and _ask(run, 0).setup.batchable
    while states:
        pieces = []
        for position in list(states):
            state = states[position]
            piece = _advance(run, position, state)
            if _gone(run, position, piece):
                del states[position]
            if piece is not None:
                pieces.append(piece)
        if pieces:
            yield pieces
        pasts = [_past(state.ask) for state in states.values()]
        layout = _ask(run, 0).setup.layout
        if lockstep and len(states) > 1 and LockstepBatch.joins(layout, pasts):
            yield from _lockstep(run, states)  # the prefills are done: the rest in lock-step
            return


def _lockstep(run: Run, states: dict[int, _Decoding]) -> Iterator[list[Piece]]:
    """Every member's later steps in one run of the model each (`agent.inference.
    generate_lockstep`), each row's token its member's own."""
    setup = _ask(run, next(iter(states))).setup
    batch = LockstepBatch.align(
        setup.layout, [(p, s.inputs, _past(s.ask)) for p, s in states.items()]
    )
    while batch.positions:
        pieces: list[Piece] = []
        staying = []
        for position in batch.positions:
            leaving, piece = _leaving(run, position, states[position])
            if piece is not None:
                pieces.append(piece)
            if not leaving:
                staying.append(position)
        batch.keep(staying)
        if staying:
            outputs = run.model(batch.inputs, setup.device_cache)
            logits = outputs[setup.layout.logits]
            tokens, going = [], []
            for row, position in enumerate(batch.positions):
                token, piece = _took(position, states[position], logits[row, -1])
                tokens.append(token)
                if piece is not None:
                    pieces.append(piece)
                if states[position].ask.finish_reason is None:
                    going.append(position)
            batch.advance(outputs, tokens)
            batch.keep(going)
        if pieces:
            yield pieces


def _past(ask: GenerateAsk) -> int:
    """The tokens a member's cache holds before its next run."""
    return len(ask.decoder_ids) + len(ask.tokens) - 1


def _gone(run: Run, position: int, piece: Piece | None) -> bool:
    """The member left the run without a last piece (shutdown, refused reply), or finished."""
    return position in run.failed or (piece is not None and piece.last)


def _rules(ask: GenerateAsk) -> TokenRules:
    assert ask.rules is not None  # `ask_of` made them
    return ask.rules


def _ask(run: Run, position: int) -> GenerateAsk:
    ask = run.members[position].generation
    assert isinstance(ask, GenerateAsk)  # the runner made it (agent.inference.runner)
    return ask


def _advance(run: Run, position: int, state: _Decoding) -> Piece | None:
    """One new token of one member; its piece where one is due."""
    leaving, piece = _leaving(run, position, state)
    if leaving:
        return piece
    outputs = run.model(state.inputs, state.ask.setup.device_cache)
    token, piece = _took(position, state, _last_logits(outputs, state.ask))
    if state.ask.finish_reason is None:
        state.inputs = _next_inputs(state, outputs, token)
    return piece


def _leaving(run: Run, position: int, state: _Decoding) -> tuple[bool, Piece | None]:
    """Before a member's next run: (True, its last piece or None) where it leaves the run
    (failed meanwhile, cancelled: by `ROOT/cancel` with a last piece, by a stop without)."""
    member, ask = run.members[position], state.ask
    if position in run.failed:
        return True, None
    if member.cancelled.is_set():
        if not member.cancelled.by_request:
            run.failed[position] = Cancelled()
            return True, None
        ask.finish_reason = "cancelled"
        return True, _piece(position, state)
    return False, None


def _took(
    position: int, state: _Decoding, logits: np.ndarray[Any, Any]
) -> tuple[int, Piece | None]:
    """The member's next token chosen from its row of logits, noted; its piece where one is
    due (`ask.finish_reason` set where the token ended the generation)."""
    ask = state.ask
    rules = _rules(ask)
    token = rules.forced()
    if token is None:
        token = ask.sampler.choose(rules.allowed(logits))
    ask.sampler.see((token,))
    rules.see(token)
    if ask.first_token_at is None:
        ask.first_token_at = time.monotonic()
    ask.tokens.append(token)
    state.pending.append(token)
    if ask.text is not None:
        state.pending_text += ask.text.push([token])
    ask.finish_reason = _finished(ask, token)
    if ask.finish_reason is None and len(state.pending) < ask.tokens_per_chunk:
        return token, None
    return token, _piece(position, state)


def _finished(ask: GenerateAsk, token: int) -> str | None:
    if token in ask.setup.eos:
        return "eos"
    if ask.text is not None and ask.text.stopped:
        return "stop"
    if len(ask.tokens) >= ask.max_new_tokens:
        return "length"
    return None


def _piece(position: int, state: _Decoding) -> Piece:
    """The member's pending tokens (and their text) as a piece; its last where it finished."""
    ask = state.ask
    last = ask.finish_reason is not None
    if last and ask.text is not None:
        state.pending_text += ask.text.finish()
    tokens = np.array(state.pending, dtype=np.int64)
    extra = None if ask.text is None else {"text": state.pending_text}
    sent = len(ask.tokens) - len(state.pending)  # tokens already in pieces
    piece = Piece(position, sent, {"tokens": tokens}, last, extra=extra)
    piece.chunk = bool(state.pending) or bool(state.pending_text)
    state.pending, state.pending_text = [], ""
    return piece


def _last_logits(outputs: Arrays, ask: GenerateAsk) -> np.ndarray[Any, Any]:
    logits = outputs[ask.setup.layout.logits]
    if logits.ndim != 3 or logits.shape[0] != 1:
        raise InferenceError(f"logits {list(logits.shape)}: expected [1, sequence, vocab]")
    row: np.ndarray[Any, Any] = logits[0, -1]
    return row


def _prefill_inputs(ask: GenerateAsk) -> Arrays:
    """The decoder's first ids whole, with an empty past."""
    return _sequence_inputs(ask.setup.layout, ask.decoder_ids)


def _encoded(run: Run, ask: GenerateAsk) -> Arrays:
    """An encoder-decoder's decoder inputs from its encoder's run on the prompt (nothing for a
    decoder alone)."""
    encoder, cross = ask.setup.encoder, ask.setup.layout.cross
    if encoder is None or cross is None:
        return {}
    if ask.features is not None:
        encoder_inputs = {encoder.input.name: ask.features}
    else:
        encoder_inputs = encoder.inputs(ask.prompt)
    states = run.other(encoder.session, encoder_inputs)[encoder.output]
    made: Arrays = {cross.states: states}
    if cross.mask is not None and cross.mask_dtype is not None:
        made[cross.mask] = np.ones((1, states.shape[1]), dtype=cross.mask_dtype)
    return made


def _sequence_inputs(layout: DecoderLayout, ids: list[int]) -> Arrays:
    """`ids` whole, with an empty past: a prefill, or every run of a decoder without a cache."""
    inputs: Arrays = {layout.input_ids: np.array([ids], dtype=layout.int_dtypes[layout.input_ids])}
    if layout.attention_mask is not None:
        dtype = layout.int_dtypes[layout.attention_mask]
        inputs[layout.attention_mask] = np.ones((1, len(ids)), dtype=dtype)
    if layout.position_ids is not None:
        dtype = layout.int_dtypes[layout.position_ids]
        inputs[layout.position_ids] = np.arange(len(ids), dtype=dtype)[None, :]
    if layout.cache_branch is not None:
        inputs[layout.cache_branch] = np.zeros((1,), dtype=np.bool_)
    for slot in layout.cache:
        inputs[slot.input] = slot.empty(1)
    return inputs


def _next_inputs(state: _Decoding, outputs: Arrays, token: int) -> Arrays:
    """One new token, the past from `present.*`, the mask and the positions one longer; for
    a decoder without a cache, the whole sequence again."""
    ask = state.ask
    layout = ask.setup.layout
    if not layout.cache:
        return {**_sequence_inputs(layout, [*ask.decoder_ids, *ask.tokens]), **state.cross}
    past = _past(ask)  # tokens the cache holds after this run
    state.token[0, 0] = token
    nxt: Arrays = {layout.input_ids: state.token, **state.cross}
    if state.mask is not None and layout.attention_mask is not None:
        nxt[layout.attention_mask] = state.mask[:, : past + 1]
    if state.position is not None and layout.position_ids is not None:
        state.position[0, 0] = past
        nxt[layout.position_ids] = state.position
    if layout.cache_branch is not None:
        nxt[layout.cache_branch] = _USE_CACHE
    for slot in layout.cache:
        if not slot.fixed:
            nxt[slot.input] = outputs[slot.output]
        elif slot.input not in state.cross:  # the first run made it; later ones a placeholder
            nxt[slot.input] = state.cross[slot.input] = outputs[slot.output]
    return nxt


modes.STRATEGIES["generate"] = generate
