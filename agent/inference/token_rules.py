"""What a generate model's configs impose on one request's next token, as `generate`'s logits
processors impose it (`agent.models.token_settings` reads them): a forced token
(`ForcedBOSTokenLogitsProcessor`, `ForcedEOSTokenLogitsProcessor`) and tokens out of reach
(`SuppressTokensLogitsProcessor`, `SuppressTokensAtBeginLogitsProcessor`,
`NoRepeatNGramLogitsProcessor`, `MinLengthLogitsProcessor`,
`MinNewTokensLengthLogitsProcessor`). The choice among the rest is the sampler's
(`agent.inference.sampling`, which applies the repetition penalty).

The n-grams are kept as they grow, each token adding one (`generate` finds them again at
every step): a step's ban is a lookup. Imports only `agent.models.token_settings`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from agent.models.token_settings import TokenSettings

__all__ = ["TokenRules"]


class TokenRules:
    """One request's rules: the settings, its eos ids and its `max_new_tokens`; `start` with
    the decoder's first ids, `see` each new token."""

    def __init__(self, settings: TokenSettings, eos: Collection[int], max_new_tokens: int) -> None:
        self.settings = settings
        self.eos = sorted(eos)
        self.max_new_tokens = max_new_tokens
        self.made = 0  # new tokens so far
        self._begin = 0  # the new token `begin_suppress` bars
        self._start_length = 0  # the decoder's first ids
        self._ngrams: dict[tuple[int, ...], set[int]] = {}  # (n-1 ids) -> the ids after them
        self._tail: list[int] = []  # the last n-1 ids
        self._bars_nothing = settings.bars_nothing

    def start(self, decoder_ids: Sequence[int]) -> None:
        """The ids the decoder reads before its first new token (a prompt, a start token)."""
        settings = self.settings
        self._start_length = len(decoder_ids)
        # `generate` counts the first new token from the input's end, one further where it
        # forces that token after a one-token start (an encoder-decoder's).
        one_token_start = len(decoder_ids) == 1
        self._begin = 1 if settings.forced_bos is not None and one_token_start else 0
        for token in decoder_ids:
            self._grow(token)

    def see(self, token: int) -> None:
        """A new token, chosen."""
        self.made += 1
        self._grow(token)

    def forced(self) -> int | None:
        """The token the configs force next (`forced_bos_token_id` first,
        `forced_eos_token_id` last), or None."""
        settings = self.settings
        if not self.made and settings.forced_bos is not None:
            return settings.forced_bos
        if self.made == self.max_new_tokens - 1 and settings.forced_eos is not None:
            return settings.forced_eos
        return None

    def allowed(self, logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The row of `logits` with the tokens barred at this step at minus infinity (a copy;
        the row itself where none is)."""
        if self._bars_nothing:
            return logits
        banned = self._banned()
        if not banned:
            return logits
        row: np.ndarray[Any, Any] = logits.copy()
        vocab = row.shape[-1]
        row[[t for t in banned if 0 <= t < vocab]] = -np.inf
        return row

    def _banned(self) -> list[int]:
        settings = self.settings
        banned = list(settings.suppress)
        if settings.begin_suppress and self.made == self._begin:
            banned += settings.begin_suppress
        short = self._start_length + self.made < settings.min_length
        if short or self.made < settings.min_new_tokens:
            banned += self.eos
        if settings.no_repeat_ngram:
            banned += self._ngrams.get(tuple(self._tail), ())
        return banned

    def _grow(self, token: int) -> None:
        n = self.settings.no_repeat_ngram
        if not n:
            return
        if len(self._tail) == n - 1:
            self._ngrams.setdefault(tuple(self._tail), set()).add(token)
        self._tail.append(token)
        if len(self._tail) > n - 1:
            del self._tail[0]
