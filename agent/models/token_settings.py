"""What a generate version's configs impose on its tokens, read once at load.

`generate` turns settings of `generation_config.json` (else `config.json`) into logits
processors; the agent applies the same ones (`agent.inference.token_rules`):
`forced_bos_token_id` and `forced_eos_token_id` (the first and the last new token),
`suppress_tokens` and `begin_suppress_tokens` (never chosen; not chosen first),
`no_repeat_ngram_size` (no n-gram of the decoder's ids twice), `min_length` and
`min_new_tokens` (no eos before them), and `repetition_penalty` (the default of the request's
`params.repetition_penalty`); and the search: `num_beams` (beam search where above 1, the
default of `params.num_beams`), with its `length_penalty` and `early_stopping`
(`agent.inference.beam`). What it does not apply (sampling by default, banned word lists, the
encoder's n-grams) is named in a warning at load (`unapplied`).

Imports only `backends.base` and `hf_files`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent.models.backends.base import ModelLoadError
from agent.models.hf_files import whole_number

__all__ = ["TokenSettings", "first_number", "token_settings_of", "unapplied"]

Configs = tuple[dict[str, Any], ...]  # generation_config.json, config.json: the first that says
MAX_PENALTY = 100.0  # as params.repetition_penalty's bound
MAX_BEAMS = 16  # as params.num_beams' bound


@dataclass(frozen=True)
class TokenSettings:
    """The settings of one version (see the module docstring); the defaults apply none."""

    forced_bos: int | None = None
    forced_eos: int | None = None
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()
    no_repeat_ngram: int = 0  # 0: off
    min_length: int = 0  # the decoder's ids (its prompt or start) and new tokens, before an eos
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    num_beams: int = 1  # above 1: beam search, unless a request samples
    length_penalty: float = 1.0  # a finished beam's score: log-probability / length ** this
    early_stopping: bool | str = False  # True, False or "never", as `generate` reads it

    @property
    def bars_nothing(self) -> bool:
        """Whether no token is ever barred (most decoders): logits pass as they are."""
        return not (
            self.suppress
            or self.begin_suppress
            or self.min_length
            or self.min_new_tokens
            or self.no_repeat_ngram
        )


def token_settings_of(
    configs: Configs, vocab: int | None, source: str = "generation_config.json"
) -> TokenSettings:
    """The settings `configs` give (ModelLoadError, naming `source`, the file the first of
    `configs` came from, for a value of the wrong kind)."""
    generation = configs[0]
    try:
        return TokenSettings(
            forced_bos=first_number(configs, "forced_bos_token_id"),
            forced_eos=first_number(configs, "forced_eos_token_id"),
            suppress=_token_list(configs, "suppress_tokens", vocab),
            begin_suppress=_token_list(configs, "begin_suppress_tokens", vocab),
            no_repeat_ngram=_count(generation, "no_repeat_ngram_size"),
            min_length=_count(generation, "min_length"),
            min_new_tokens=_count(generation, "min_new_tokens"),
            repetition_penalty=_penalty(generation),
            num_beams=max(1, min(_count(generation, "num_beams"), MAX_BEAMS)),
            length_penalty=_float(generation, "length_penalty", 1.0),
            early_stopping=_early_stopping(generation),
        )
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from None


def unapplied(generation_config: dict[str, Any]) -> list[str]:
    """The settings of `generation_config.json` that `generate` would apply by default and the
    agent does not (sampling by default, several answers, banned words, the encoder's n-grams)."""
    defaults: dict[str, Any] = {
        "do_sample": False,
        "num_return_sequences": 1,
        "num_beam_groups": 1,
        "bad_words_ids": None,
        "encoder_no_repeat_ngram_size": 0,
    }
    return [
        f"{key} = {json.dumps(generation_config[key])}"
        for key, default in defaults.items()
        if generation_config.get(key, default) not in (default, None)
    ]


def first_number(configs: Configs, key: str) -> int | None:
    """`key` of the first of `configs` that gives a whole number for it."""
    for data in configs:
        value = whole_number(data.get(key))
        if value is not None:
            return value
    return None


def _token_list(configs: Configs, key: str, vocab: int | None) -> tuple[int, ...]:
    """The token ids `key` of the first of `configs` that gives a list (those in the
    vocabulary: `generate` ignores the others)."""
    for data in configs:
        value = data.get(key)
        if isinstance(value, list):
            ids = (whole_number(v) for v in value)
            return tuple(i for i in ids if i is not None and 0 <= i < (vocab or i + 1))
    return ()


def _count(generation_config: dict[str, Any], key: str) -> int:
    value = generation_config.get(key)
    if value is None:
        return 0
    number = whole_number(value)
    if number is None or number < 0:
        raise ValueError(f"{key} = {value!r} is not a count")
    return number


def _float(generation_config: dict[str, Any], key: str, default: float) -> float:
    value = generation_config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} = {value!r} is not a number")
    return float(value)


def _early_stopping(generation_config: dict[str, Any]) -> bool | str:
    value = generation_config.get("early_stopping", False)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if value != "never":
        raise ValueError(f"early_stopping = {value!r}")
    return "never"


def _penalty(generation_config: dict[str, Any]) -> float:
    value = _float(generation_config, "repetition_penalty", 1.0)
    if not 0.0 < value <= MAX_PENALTY:
        raise ValueError(f"repetition_penalty = {value} is not in (0, {MAX_PENALTY}]")
    return value
