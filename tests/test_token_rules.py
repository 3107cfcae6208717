"""What a generate model's configs impose on its tokens (`agent.inference.token_rules`),
step by step, counted as `generate`'s logits processors count. The models' own references are
in tests/test_generate_seq2seq.py (n-gram bans, penalty, minimum length) and
tests/test_generate_whisper.py (suppressed tokens)."""

from __future__ import annotations

import dataclasses

import numpy as np

from agent.inference.token_rules import TokenRules
from agent.models.token_settings import TokenSettings

LOGITS = np.arange(6, dtype=np.float32)


def barred(rules: TokenRules) -> list[int]:
    row = rules.allowed(LOGITS)
    return [int(i) for i in np.flatnonzero(np.isinf(row))]


def started(settings: TokenSettings, start: list[int], eos: int = 0) -> TokenRules:
    rules = TokenRules(settings, {eos}, 8)
    rules.start(start)
    return rules


def test_the_token_rules_count_steps_as_generate_does() -> None:
    """`begin_suppress_tokens` bar the first new token, or the second where the config
    forces the first after a one-token start (`generate`'s `begin_index`); `suppress_tokens`
    every one; the forced first token comes before any choice."""
    settings = TokenSettings(suppress=(1,), begin_suppress=(2,))
    plain = started(settings, [3])
    assert barred(plain) == [1, 2]
    plain.see(4)
    assert barred(plain) == [1]
    forcing = started(dataclasses.replace(settings, forced_bos=5), [3])
    assert forcing.forced() == 5 and barred(forcing) == [1]
    forcing.see(5)
    assert forcing.forced() is None and barred(forcing) == [1, 2]
    assert barred(started(dataclasses.replace(settings, forced_bos=5), [3, 4])) == [1, 2]
    assert not np.isinf(LOGITS).any(), "the row itself is left as it was"


def test_min_length_counts_the_decoders_first_ids_and_min_new_tokens_does_not() -> None:
    """Two first ids: `min_length = 3` bars the eos for the first new token only,
    `min_new_tokens = 2` for the first two."""
    by_length = started(TokenSettings(min_length=3), [3, 4], eos=5)
    by_new = started(TokenSettings(min_new_tokens=2), [3, 4], eos=5)
    assert barred(by_length) == [5] and barred(by_new) == [5]
    by_length.see(1)
    by_new.see(1)
    assert barred(by_length) == [] and barred(by_new) == [5]
    by_new.see(2)
    assert barred(by_new) == []


def test_an_ngram_of_the_prompt_and_the_output_is_not_made_twice() -> None:
    """A 2-gram ban: after a token, none of the tokens that followed it before, in the
    decoder's first ids or in the output; a 1-gram ban: no token seen at all."""
    rules = started(TokenSettings(no_repeat_ngram=2), [1, 2, 1, 3])
    assert barred(rules) == []  # after 3: nothing followed a 3 yet
    rules.see(1)
    assert sorted(barred(rules)) == [2, 3]  # 1 2 and 1 3 were made
    rules.see(4)
    assert barred(rules) == []
    once = started(TokenSettings(no_repeat_ngram=1), [1, 2])
    once.see(4)
    assert sorted(barred(once)) == [1, 2, 4]
