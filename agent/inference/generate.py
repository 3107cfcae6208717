"""`mode = "generate"`: token streaming from an exported decoder (the strategy of the runner).

A request is checked into a `GenerateAsk` (prompt ids, limits, sampling, stop strings) by
`ask_of` (`agent.inference.generate_ask`, re-exported here); the strategy :func:`generate`
(registered in `agent.inference.modes.STRATEGIES`) then runs each member as Hugging Face's
`generate` does: a prefill of the whole prompt with an empty past (past length 0), then one
run per new token with the past taken from `present.*`, the attention mask and positions grown
by one. The token is chosen outside the graph (`agent.inference.sampling`); the generation
ends at an eos token (`eos`), at `max_new_tokens` (`length`), at a stop string (`stop`) or when
`ROOT/cancel` asked (`cancelled`). Every `tokens_per_chunk` tokens are one piece,
`outputs: {tokens: int64 [k]}` and, with a tokenizer, the piece's `text`
(`agent.inference.text_stream`).

An encoder-decoder (`Generation.encoder`) runs its encoder once on the prompt first; the
decoder then starts from its start token, takes the encoder's states at every run, and feeds
the cross-attention's cache of its first run unchanged to the others (`CacheSlot.fixed`).
A speech recogniser's encoder reads the request's recording as log-mel features, and its
decoder starts from a prompt of language and task tokens (`agent.inference.speech`); an image
encoder reads the request's picture as pixel values (`agent.inference.pictures`). What the
model's configs force or bar at each token is `agent.inference.token_rules`'.

Members of one run (requests queued together, where the model has `[batching]`) run their
prefills one by one, then every later step together, a row each
(`agent.inference.generate_lockstep`); a layout without the mask or explicit positions, which
left padding needs, has them interleave, a run each in turn. A beam search
(`agent.inference.beam`) runs its beams as the rows of its own runs, never in lock-step with
others. On the CPU the cache stays what the session returns (numpy, fed back without a copy:
`OrtValue`s measured slower there); on a GPU provider it stays on the device
(`Generation.device_cache`). A step allocates nothing of its own but the token list. There, a
prefill may start from the version's prefix cache (`agent.models.prefix_cache`), and a member
alone in its run may read guessed tokens with its step (`agent.inference.prompt_lookup`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from agent.inference import modes, prompt_lookup, speech
from agent.inference.beam import BeamDecoding
from agent.inference.generate_ask import GenerateAsk, ask_of
from agent.inference.generate_inputs import (
    USE_CACHE,
    cached_prefill,
    continued,
    encoded,
    prefill_inputs,
    sequence_inputs,
)
from agent.inference.generate_lockstep import LockstepBatch
from agent.inference.job import Cancelled
from agent.inference.modes import Arrays, Piece, Run
from agent.inference.token_rules import TokenRules
from agent.models.backends.base import InferenceError
from agent.models.prefix_cache import PrefixCache

__all__ = ["GenerateAsk", "ask_of", "generate"]

# -- the strategy -----------------------------------------------------------------------------


class _Decoding:
    """One member's loop state: the next run's inputs, the tokens and text not yet sent, and
    the step inputs made once (the mask a view of one row of ones as long as the generation
    can grow; the new token and its position written in place before each run)."""

    def __init__(self, ask: GenerateAsk, cross: Arrays, prefill: Arrays, alone: bool) -> None:
        self.ask = ask
        # An encoder-decoder's decoder inputs of its encoder's run, and its cross-attention
        # cache once the first run made it: the same at every run.
        self.cross = cross
        self.inputs = prefill  # the first run's: the decoder's first ids whole
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
        # Prompt lookup's guesses: only for a member alone in its run (lock-step reads one
        # token a row).
        guessing = ask.lookup and alone
        self.lookup = prompt_lookup.Lookup(ask.lookup, ask.decoder_ids) if guessing else None
        ask.sampler.see(ask.decoder_ids)  # as `generate` sees the decoder's input_ids
        # What the configs force or bar at each token, on this member's own sequence.
        self.rules = TokenRules(ask.setup.token_settings, ask.setup.eos, ask.max_new_tokens)
        self.rules.start(ask.decoder_ids)

    def cancel(self, position: int) -> Piece:
        """The last piece of a generation cancelled by `ROOT/cancel`: what is pending."""
        self.ask.finish_reason = "cancelled"
        return _piece(position, self)


def _decoding(run: Run, ask: GenerateAsk) -> _Decoding | BeamDecoding:
    """A member's loop state, its encoder run (an encoder-decoder's) and its language
    detected (a Whisper's, where none was asked)."""
    cross = encoded(run, ask)
    prefill = None
    speech_prompt = ask.setup.speech
    if ask.language_at is not None and speech_prompt is not None:
        first = sequence_inputs(ask.setup.layout, [speech_prompt.start])
        detected = speech.detect_language(run, ask, {**first, **cross})
        if ask.prompt[0] == speech_prompt.start and ask.setup.layout.cache:
            prefill = continued(ask, detected, cross)  # the start token's cache reused
    if prefill is None:
        prefill = {**prefill_inputs(ask), **cross}
    if ask.beams > 1:
        return BeamDecoding(ask, prefill, cross)
    return _Decoding(ask, cross, prefill, alone=len(run.members) == 1)


class _Recording:
    """A speech recogniser's recording longer than its encoder's window (`ask.recording`):
    one generation a window, in order. The first is the member's own ask; each later one an
    ask of its own (`ask_of` on the window's samples, with the window before's text as its
    `inputs.prompt` and the first window's language), whose tokens, text and prompt the
    member's ask gathers, so that the stream, its `end` and a `stream: false` result are one
    transcription's. `max_new_tokens` holds for each window."""

    def __init__(self, run: Run, ask: GenerateAsk) -> None:
        assert ask.recording is not None
        self.ask = ask
        self.rest = ask.recording.rest
        self.params = ask.recording.params
        self.window = ask  # the generation of the window being transcribed
        self.state = _decoding(run, ask)
        self.offset = 0  # tokens of the windows before the current one

    def advance(self, run: Run, position: int) -> Piece | None:
        """One step of the window being transcribed; its piece as the stream's (numbered
        on, its text the member's), not the last where a next window follows."""
        piece = _advance(run, position, self.state)
        if piece is None:
            return None
        goes_on = piece.last and self._goes_on()
        if self.window is not self.ask:  # the member's ask did not see this window's tokens
            tokens = [int(t) for t in piece.outputs["tokens"]]
            self.ask.tokens.extend(tokens)
            piece.index += self.offset
            if self.ask.text is not None:
                ending = piece.last and not goes_on
                text = self.ask.text.push(tokens) + (self.ask.text.finish() if ending else "")
                piece.extra = {"text": text}
                piece.chunk = bool(tokens) or bool(text)
        if goes_on:
            self._next(run)
            piece.last = False
        elif piece.last:
            self.ask.finish_reason = self.window.finish_reason
        return piece

    def _goes_on(self) -> bool:
        return self.rest.size > 0 and self.window.finish_reason in ("eos", "length")

    def _next(self, run: Run) -> None:
        """The next window's generation, after the one that just ended."""
        setup, ended = self.ask.setup, self.window
        log_mel, tokenizer, speech_prompt = setup.log_mel, setup.tokenizer, setup.speech
        assert log_mel is not None
        samples, self.rest = self.rest[: log_mel.samples], self.rest[log_mel.samples :]
        previous = tokenizer.decode(ended.tokens).strip() if tokenizer is not None else ""
        inputs = speech.window_inputs(samples, previous if speech_prompt else "", setup)
        params = dict(self.params)
        language = speech_prompt.language_in(self.ask.prompt) if speech_prompt else None
        if language is not None:
            params["language"] = language
        self.offset = len(self.ask.tokens)
        window = ask_of(inputs, params, setup)
        window.text = None  # the member's ask makes the stream's text
        self.ask.prompt = [*self.ask.prompt, *window.prompt]
        self.window, self.state = window, _decoding(run, window)


def generate(run: Run) -> Iterator[list[Piece]]:
    states = {p: _state(run, _ask(run, p)) for p in range(len(run.members))}
    plain = all(isinstance(state, _Decoding) for state in states.values())
    lockstep = len(states) > 1 and plain and _ask(run, 0).setup.batchable
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
        if lockstep and len(states) > 1 and _joins(run, states):
            plains = cast(dict[int, _Decoding], states)  # `lockstep`: every state is one
            yield from _lockstep(run, plains)  # the prefills are done: the rest in lock-step
            return


def _joins(run: Run, states: dict[int, Any]) -> bool:
    """Whether the members left can now step in lock-step (their prefills done)."""
    pasts = [_past(state.ask) for state in states.values()]
    return LockstepBatch.joins(_ask(run, 0).setup.layout, pasts)


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


def _ask(run: Run, position: int) -> GenerateAsk:
    ask = run.members[position].generation
    assert isinstance(ask, GenerateAsk)  # the runner made it (agent.inference.runner)
    return ask


def _state(run: Run, ask: GenerateAsk) -> _Decoding | BeamDecoding | _Recording:
    """A member's loop state (a long recording's: window after window)."""
    return _Recording(run, ask) if ask.recording is not None else _decoding(run, ask)


def _advance(run: Run, position: int, state: _Decoding | BeamDecoding | _Recording) -> Piece | None:
    """One new token of one member (one step of its search); its piece where one is due."""
    if isinstance(state, _Recording):
        return state.advance(run, position)
    leaving, piece = _leaving(run, position, state)
    if leaving:
        return piece
    if isinstance(state, BeamDecoding):
        return state.advance(run, position)
    ask, store = state.ask, state.ask.setup.prefix_cache
    if store is not None and not ask.tokens:  # a decoder alone (`Generation.prefix_cache`)
        state.inputs = cached_prefill(ask, store, state.inputs)
    if state.lookup is not None and ask.tokens:  # a member alone in its run
        guessed = state.lookup.guesses(ask.max_new_tokens - len(ask.tokens) - 1)
        if guessed:
            return _advance_guessed(run, position, state, guessed)
    outputs = run.model(state.inputs, ask.setup.device_cache)
    token, piece = _took(position, state, _last_logits(outputs, ask))
    if ask.finish_reason is None:
        state.inputs = _next_inputs(state, outputs, token)
    if store is not None and (len(ask.tokens) == 1 or ask.finish_reason):
        _keep(ask, store, outputs)
    return piece


def _advance_guessed(run: Run, position: int, state: _Decoding, guessed: list[int]) -> Piece | None:
    """One run of the step's token and the tokens `guessed` after it
    (`agent.inference.prompt_lookup`): each row's greedy token kept while it is the guess that
    follows, then the row after the last guess kept gives one more; the cache cut to them."""
    ask = state.ask
    layout = ask.setup.layout
    inputs = sequence_inputs(layout, [ask.tokens[-1], *guessed], past=_past(ask))
    for slot in layout.cache:
        inputs[slot.input] = state.inputs[slot.input]
    outputs = run.model(inputs, ask.setup.device_cache)
    logits = outputs[layout.logits]
    if logits.ndim != 3 or logits.shape[:2] != (1, len(guessed) + 1):
        raise InferenceError(
            f"logits {list(logits.shape)}: expected [1, {len(guessed) + 1}, vocab]"
        )
    token, right = -1, 0
    for row in range(len(guessed) + 1):
        token = _chose(state, logits[0, row])
        if ask.finish_reason is not None or row == len(guessed) or token != guessed[row]:
            break
        right += 1
    assert state.lookup is not None
    state.lookup.checked(len(guessed), right)
    kept = prompt_lookup.cut_cache(layout, outputs, _past(ask), ask.setup.device_cut)
    if ask.finish_reason is None:
        state.inputs = _next_inputs(state, kept, token)
    elif ask.setup.prefix_cache is not None:
        _keep(ask, ask.setup.prefix_cache, kept)
    return _due(position, state)


def _keep(ask: GenerateAsk, store: PrefixCache, outputs: Arrays) -> None:
    """The cache this run returned, kept for later prompts that begin the same way: after the
    prefill it holds the prompt, after the last run the prompt and every new token but the
    last (which no run read)."""
    cache = {slot.input: outputs[slot.output] for slot in ask.setup.layout.cache}
    store.keep([*ask.decoder_ids, *ask.tokens[:-1]], cache)


def _leaving(run: Run, position: int, state: _Decoding | BeamDecoding) -> tuple[bool, Piece | None]:
    """Before a member's next run: (True, its last piece or None) where it leaves the run
    (failed meanwhile, cancelled: by `ROOT/cancel` with a last piece, by a stop without)."""
    member = run.members[position]
    if position in run.failed:
        return True, None
    if member.cancelled.is_set():
        if not member.cancelled.by_request:
            run.failed[position] = Cancelled()
            return True, None
        return True, state.cancel(position)
    return False, None


def _took(
    position: int, state: _Decoding, logits: np.ndarray[Any, Any]
) -> tuple[int, Piece | None]:
    """The member's next token chosen from its row of logits, noted; its piece where one is
    due (`ask.finish_reason` set where the token ended the generation)."""
    token = _chose(state, logits)
    return token, _due(position, state)


def _chose(state: _Decoding, logits: np.ndarray[Any, Any]) -> int:
    """The member's next token chosen from its row of logits and noted (`ask.finish_reason`
    set where it ended the generation)."""
    ask = state.ask
    rules = state.rules
    token = rules.forced()
    if token is None:
        token = ask.sampler.choose(rules.allowed(logits))
    ask.sampler.see((token,))
    rules.see(token)
    if state.lookup is not None:
        state.lookup.push((token,))
    if ask.first_token_at is None:
        ask.first_token_at = time.monotonic()
    ask.tokens.append(token)
    state.pending.append(token)
    if ask.text is not None:
        state.pending_text += ask.text.push([token])
    ask.finish_reason = _finished(ask, token)
    return int(token)


def _due(position: int, state: _Decoding) -> Piece | None:
    """The member's piece, where one is due: `tokens_per_chunk` tokens pending, or the end."""
    ask = state.ask
    if ask.finish_reason is None and len(state.pending) < ask.tokens_per_chunk:
        return None
    return _piece(position, state)


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


def _next_inputs(state: _Decoding, outputs: Arrays, token: int) -> Arrays:
    """One new token, the past from `present.*`, the mask and the positions one longer; for
    a decoder without a cache, the whole sequence again."""
    ask = state.ask
    layout = ask.setup.layout
    if not layout.cache:
        return {**sequence_inputs(layout, [*ask.decoder_ids, *ask.tokens]), **state.cross}
    past = _past(ask)  # tokens the cache holds after this run
    state.token[0, 0] = token
    nxt: Arrays = {layout.input_ids: state.token, **state.cross}
    if state.mask is not None and layout.attention_mask is not None:
        nxt[layout.attention_mask] = state.mask[:, : past + 1]
    if state.position is not None and layout.position_ids is not None:
        state.position[0, 0] = past
        nxt[layout.position_ids] = state.position
    if layout.cache_branch is not None:
        nxt[layout.cache_branch] = USE_CACHE
    for slot in layout.cache:
        if not slot.fixed:
            nxt[slot.input] = outputs[slot.output]
        elif slot.input not in state.cross:  # the first run made it; later ones a placeholder
            nxt[slot.input] = state.cross[slot.input] = outputs[slot.output]
    return nxt


modes.STRATEGIES["generate"] = generate
