"""Beam search for `mode = "generate"`, streamed as its beams agree.

A generation with `num_beams` > 1 (the request's `params.num_beams`, else the model's
`generation_config.json`) keeps that many sequences, a row each in one run of the decoder, and
finds the best as `transformers`' `GenerationMixin._beam_search` finds it, step for step: the
log-softmax of each row's logits, the configs' rules applied to it (`agent.inference.
token_rules`: bans, forced tokens; the repetition penalty on the log-probabilities), the
running scores added; the best `max(2, 1 + eos ids) * num_beams` continuations of all rows;
those ending (an eos, or the length) among the first `num_beams` joining the finished
hypotheses with their score divided by `length ** length_penalty`, the others the next rows
(their caches gathered row by row); the same early-stop rule (`early_stopping`: True, False,
"never"). The answer is the best finished hypothesis.

Streaming a beam search: a token is sent once every running row and every finished hypothesis
that could still be the answer holds it at its place, so no chunk is taken back; the rest
comes with the last chunk. The first rows are the prompt's prefill repeated (one run, as
`generate`'s identical rows), the second row on held at -1e9 at the first step, as there.

Imports numpy, the layout and the runner's pieces; the request's inputs are made by
`agent.inference.generate`, which drives it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from agent.inference.generate_inputs import USE_CACHE
from agent.inference.generate_lockstep import on_host
from agent.inference.modes import Arrays, Piece, Run
from agent.inference.token_rules import TokenRules
from agent.models.backends.base import InferenceError

if TYPE_CHECKING:
    from agent.inference.generate_ask import GenerateAsk

__all__ = ["BeamDecoding"]

_LOST = np.float32(-1e9)  # `generate`'s score of a row that cannot win


class BeamDecoding:
    """One request's beam search: `advance` runs one step (the prefill first) and gives its
    piece, if any tokens were settled."""

    def __init__(self, ask: GenerateAsk, prefill: Arrays, cross: Arrays) -> None:
        self.ask = ask
        self.beams = ask.beams
        setup = ask.setup
        self.settings = setup.token_settings
        self.eos = sorted(setup.eos)
        self.start = list(ask.decoder_ids)
        self.max_length = len(self.start) + ask.max_new_tokens
        self.keep = max(2, 1 + len(self.eos)) * self.beams
        k = self.beams
        self.running = np.zeros((k, self.max_length), dtype=np.int64)
        self.running[:, : len(self.start)] = self.start
        self.scores = np.full(k, _LOST, dtype=np.float32)
        self.scores[0] = 0.0
        self.done_ids = np.zeros((k, self.max_length), dtype=np.int64)
        self.done_lengths = np.zeros(k, dtype=np.int64)
        self.done_scores = np.full(k, _LOST, dtype=np.float32)
        self.done = np.zeros(k, dtype=np.bool_)
        self.improvable = True
        self.length = len(self.start)  # ids in each running row
        # on the host: a detection's cache may be a device session's values (beams run unbound)
        self.inputs = {name: on_host(value) for name, value in prefill.items()}
        self.cross = {name: np.repeat(on_host(value), k, axis=0) for name, value in cross.items()}
        self.sent = 0  # tokens already in pieces
        self.finished = False
        # The rules every row shares where they keep no n-grams (their state is then the
        # count of new tokens alone): made once, told of each step. None: each row replays
        # its own sequence (its n-grams are its own).
        self._shared_rules: TokenRules | None = None
        if not self.settings.no_repeat_ngram:
            self._shared_rules = TokenRules(self.settings, self.eos, ask.max_new_tokens)
            self._shared_rules.start(self.start)

    def advance(self, run: Run, position: int) -> Piece | None:
        """One run of the decoder and one step of the search; the piece of the tokens it
        settled (the last piece when the search ends), or None."""
        outputs = run.model(self.inputs)
        logits = outputs[self.ask.setup.layout.logits]
        if logits.ndim != 3 or logits.shape[0] not in (1, self.beams):
            raise InferenceError(f"logits {list(logits.shape)}: expected [beams, sequence, vocab]")
        rows = np.broadcast_to(logits[:, -1], (self.beams, logits.shape[-1]))
        chosen = self._step(rows.astype(np.float32))
        if self.finished:
            return self._last_piece(position)
        self.inputs = self._next_inputs(outputs, chosen)
        return self._settled_piece(position)

    def cancel(self, position: int) -> Piece:
        """The last piece of a search cancelled by `ROOT/cancel`: the tokens settled."""
        self.ask.finish_reason = "cancelled"
        return self._piece(position, self.ask.tokens[self.sent :], last=True)

    # -- the search ---------------------------------------------------------------------

    def _step(self, logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """One step of `_beam_search` on the rows' logits `[beams, vocab]`; the rows the next
        running rows continue (their caches' rows)."""
        k, vocab = self.beams, logits.shape[-1]
        scores = self._processed(_log_softmax(logits)) + self.scores[:, None]
        flat = scores.reshape(-1)
        top = _best(flat, self.keep)
        top_scores, rows, tokens = flat[top], top // vocab, top % vocab
        used = self.length + 1  # the ids every row holds after this step
        candidates = self.running[:, :used][rows]  # copies of what is used, not the whole row
        candidates[:, self.length] = tokens
        ends = np.isin(tokens, self.eos) | (self.length + 1 >= self.max_length)
        running_scores = (top_scores + ends.astype(np.float32) * _LOST).astype(np.float32)
        nxt = np.argsort(-running_scores, kind="stable")[:k]
        self.running[:, :used], self.scores = candidates[nxt], running_scores[nxt]
        self._finish(candidates, top_scores, ends)
        self.length += 1
        if self._shared_rules is not None:  # the token's value is not read without n-grams
            self._shared_rules.see(int(self.running[0, self.length - 1]))
        self._check_improvable()
        open_rows = not (self.done.all() and self.settings.early_stopping is True)
        if not (self.improvable and open_rows and not ends.all()):
            self.finished = True
        chosen: np.ndarray[Any, Any] = rows[nxt]
        return chosen

    def _processed(self, log_probs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Each row's log-probabilities through the configs' rules, on its own sequence."""
        settings = self.settings
        penalty = self.ask.sampler.params.repetition_penalty
        forcing = settings.forced_bos is not None or settings.forced_eos is not None
        if settings.bars_nothing and not forcing and penalty == 1.0:
            return log_probs
        out: np.ndarray[Any, Any] = log_probs.copy()
        for row in range(self.beams):
            sequence = self.running[row, : self.length]
            rules = self._shared_rules or self._replayed(sequence)
            values = out[row]
            if penalty != 1.0:
                seen = np.unique(sequence)
                picked = values[seen]
                values[seen] = np.where(picked < 0, picked * penalty, picked / penalty)
            forced = rules.forced()
            if forced is not None:
                values[:] = -np.inf
                values[forced] = 0.0
            out[row] = rules.allowed(values)
        return out

    def _replayed(self, sequence: np.ndarray[Any, Any]) -> TokenRules:
        """The rules of one row, its n-grams read from its `sequence`."""
        rules = TokenRules(self.settings, self.eos, self.ask.max_new_tokens)
        rules.start(self.start)
        for token in sequence[len(self.start) :]:
            rules.see(int(token))
        return rules

    def _finish(
        self, candidates: np.ndarray[Any, Any], scores: np.ndarray[Any, Any], ends: Any
    ) -> None:
        """The candidates among the first `beams` that end join the finished hypotheses, each
        scored by its length; the best `beams` of all are kept."""
        k, generated = self.beams, self.length + 1 - len(self.start)
        just = ends & (np.arange(self.keep) < k)
        normed = (scores / np.float32(generated**self.settings.length_penalty)).astype(np.float32)
        full = self.done.all() and self.settings.early_stopping is True
        normed = normed + np.float32(full) * _LOST + np.float32(not self.improvable) * _LOST
        normed = (normed + (~just).astype(np.float32) * _LOST).astype(np.float32)
        merged_scores = np.concatenate([self.done_scores, normed])
        pick = np.argsort(-merged_scores, kind="stable")[:k]
        self.done_scores = merged_scores[pick]
        used = candidates.shape[1]  # a kept hypothesis is no longer; past it, nothing is read
        self.done_ids[:, :used] = np.concatenate([self.done_ids[:, :used], candidates])[pick]
        lengths = np.full(self.keep, generated, dtype=np.int64)
        self.done_lengths = np.concatenate([self.done_lengths, lengths])[pick]
        self.done = np.concatenate([self.done, just])[pick]

    def _check_improvable(self) -> None:
        """`_check_early_stop_heuristic`: whether the best running row could still beat the
        worst finished hypothesis."""
        settings = self.settings
        if settings.early_stopping == "never" and settings.length_penalty > 0.0:
            best_length = self.max_length - len(self.start)
        else:
            best_length = self.length - len(self.start)
        best = self.scores[0] / np.float32(best_length**settings.length_penalty)
        worst = np.where(self.done, self.done_scores.min(), _LOST)
        self.improvable = self.improvable and bool(np.any(best > worst))

    # -- the decoder's inputs -------------------------------------------------------------

    def _next_inputs(self, outputs: Arrays, rows: np.ndarray[Any, Any]) -> Arrays:
        """Each row's last token, its cache the row it continues (gathered), the mask and the
        position one further."""
        layout = self.ask.setup.layout
        ids = self.running[:, self.length - 1 : self.length]
        inputs: Arrays = {layout.input_ids: ids.astype(layout.int_dtypes[layout.input_ids])}
        if layout.attention_mask is not None:
            dtype = layout.int_dtypes[layout.attention_mask]
            inputs[layout.attention_mask] = np.ones((self.beams, self.length), dtype=dtype)
        if layout.position_ids is not None:
            dtype = layout.int_dtypes[layout.position_ids]
            inputs[layout.position_ids] = np.full((self.beams, 1), self.length - 1, dtype=dtype)
        if layout.cache_branch is not None:
            inputs[layout.cache_branch] = USE_CACHE
        inputs.update(self.cross)
        for slot in layout.cache:
            if slot.fixed and slot.input in self.cross:  # made by the first run, kept
                continue
            value = outputs[slot.output]
            if value.shape[0] == 1:  # the prefill's one row: every beam's
                value = np.repeat(value, self.beams, axis=0)
            if slot.fixed:  # the cross-attention's: made once, the same in every row
                inputs[slot.input] = self.cross[slot.input] = value
            else:
                inputs[slot.input] = np.take(value, rows, axis=0)
        return inputs

    # -- the pieces -------------------------------------------------------------------------

    def _settled_piece(self, position: int) -> Piece | None:
        """The tokens every row that could still be the answer holds, not yet sent."""
        start = len(self.start)
        rows = [row[start : self.length] for row in self.running]
        rows += [ids[start : start + n] for ids, n, d in self._done_rows() if d]
        settled = _common_prefix(rows)
        if len(settled) <= self.sent:
            return None
        self.ask.tokens = [int(t) for t in settled]
        return self._piece(position, self.ask.tokens[self.sent :], last=False)

    def _last_piece(self, position: int) -> Piece:
        best, length = self.done_ids[0], int(self.done_lengths[0])
        start = len(self.start)
        self.ask.tokens = [int(t) for t in best[start : start + length]]
        last = self.ask.tokens[-1] if self.ask.tokens else None
        self.ask.finish_reason = "eos" if last in self.eos else "length"
        return self._piece(position, self.ask.tokens[self.sent :], last=True)

    def _done_rows(self) -> list[tuple[np.ndarray[Any, Any], int, bool]]:
        return list(zip(self.done_ids, self.done_lengths.tolist(), self.done.tolist(), strict=True))

    def _piece(self, position: int, tokens: Sequence[int], last: bool) -> Piece:
        ask = self.ask
        if tokens and ask.first_token_at is None:
            ask.first_token_at = time.monotonic()
        extra = None
        if ask.text is not None:
            text = ask.text.push(list(tokens))
            extra = {"text": text + (ask.text.finish() if last else "")}
        piece = Piece(position, self.sent, {"tokens": np.array(tokens, dtype=np.int64)}, last)
        piece.extra = extra
        piece.chunk = bool(tokens) or bool(extra and extra["text"])
        self.sent += len(tokens)
        return piece


def _best(scores: np.ndarray[Any, Any], count: int) -> np.ndarray[Any, Any]:
    """The indices of the `count` highest `scores`, highest first (ties: lower index first):
    a partition, then a sort of those alone (a vocabulary of 50,000 over 4 beams sorted
    whole costs milliseconds a step)."""
    if count >= scores.size:
        return np.argsort(-scores, kind="stable")
    chosen = np.argpartition(-scores, count - 1)[:count]
    order = np.lexsort((chosen, -scores[chosen]))
    best: np.ndarray[Any, Any] = chosen[order]
    return best


def _log_softmax(logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    out: np.ndarray[Any, Any] = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out.astype(np.float32)


def _common_prefix(rows: Sequence[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    """The longest prefix all `rows` share."""
    shortest = min(len(row) for row in rows)
    first = rows[0][:shortest]
    same = np.ones(shortest, dtype=np.bool_)
    for row in rows[1:]:
        same &= row[:shortest] == first
    cut = int(np.argmin(same)) if not same.all() else shortest
    return first[:cut]
