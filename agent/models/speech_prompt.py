"""A Whisper decoder's prompt: the start, language, task and no-timestamps tokens.

Whisper's decoder does not start from one token but from a prompt its `generate` lays out
(`WhisperGenerationMixin._retrieve_init_tokens` in `transformers`), read from the version's
`generation_config.json`: `<|startoftranscript|>` (`decoder_start_token_id`); the language
(`lang_to_id`: the request's `params.language`, else the config's `language`, else the one the
model itself finds likeliest after the start token: detection); the task (`task_to_id`:
`params.task`, else the config's, else `transcribe` where a language was asked); and
`<|notimestamps|>` (`no_timestamps_token_id`): the agent streams text, not timestamps. Where
neither a language nor a task is asked, the checkpoint's `forced_decoder_ids` (`[[1, null],
[2, transcribe]]` in OpenAI's multilingual checkpoints) give the tokens after the start.

An English-only checkpoint (no `lang_to_id`) takes neither parameter. Imports only
`backends.base` and `hf_files`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.models.backends.base import ModelLoadError
from agent.models.hf_files import whole_number

__all__ = ["PromptRefused", "SpeechPrompt", "speech_prompt_of"]


class PromptRefused(ValueError):
    """A request's language or task that the model does not take (its message says why)."""


@dataclass(frozen=True)
class SpeechPrompt:
    """The prompt rules of one checkpoint (see the module docstring)."""

    start: int
    languages: Mapping[str, int]  # "en" -> the id of <|en|>
    tasks: Mapping[str, int]  # "transcribe" -> its id
    forced: tuple[int | None, ...]  # forced_decoder_ids at positions 1, 2, ...
    no_timestamps: int | None
    language: str | None = None  # the config's own language and task, where it sets them
    task: str | None = None

    def ids(self, language: str | None, task: str | None) -> list[int | None]:
        """The prompt for the request's `language` and `task` (None: not asked); a None in
        the language's place where the model is to detect it (PromptRefused where the model
        does not know one of them)."""
        language = language if language is not None else self.language
        task = task if task is not None else self.task
        ids: list[int | None] = [self.start]
        if language is None and task is None:
            ids += self.forced
        undefined = len(ids) <= 1 or ids[1] is None
        if language is not None:
            _put_language(ids, self._language_id(language))
        elif self.languages and undefined:
            _put_language(ids, None)  # detected before the first run
        if task is not None:
            task_id = self._task_id(task)
            ids = [i for i in ids if i not in self.tasks.values()] + [task_id]
        elif language is not None and self.tasks and not set(ids) & set(self.tasks.values()):
            ids.append(self.tasks.get("transcribe"))
        if self.no_timestamps is not None and ids[-1] != self.no_timestamps:
            ids.append(self.no_timestamps)
        detect = self.detects(ids)
        return [i for at, i in enumerate(ids) if i is not None or (detect and at == 1)]

    @functools.cached_property
    def language_ids(self) -> np.ndarray[Any, Any]:
        """The language tokens' ids, sorted (detection's candidates)."""
        return np.array(sorted(self.languages.values()), dtype=np.int64)

    def language_in(self, ids: list[int]) -> str | None:
        """The code of the language token after the start token of the prompt `ids` (asked,
        forced or detected), None where it has none."""
        at = ids.index(self.start) + 1 if self.start in ids else len(ids)
        if at >= len(ids):
            return None
        return next((code for code, i in self.languages.items() if i == ids[at]), None)

    @staticmethod
    def detects(ids: list[int | None]) -> bool:
        """Whether the prompt `ids` waits for a detected language."""
        return len(ids) > 1 and ids[1] is None

    def _language_id(self, language: str) -> int:
        code = language.lower().removeprefix("<|").removesuffix("|>")
        if not self.languages:
            raise PromptRefused("params.language: the model knows no languages (English only)")
        if code not in self.languages:
            known = ", ".join(sorted(self.languages)[:20])
            raise PromptRefused(f"params.language: '{code}' is not one of the model's: {known}")
        return self.languages[code]

    def _task_id(self, task: str) -> int:
        if task not in self.tasks:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise PromptRefused(f"params.task: '{task}' is not one of the model's ({known})")
        return self.tasks[task]


def speech_prompt_of(
    configs: tuple[dict[str, Any], dict[str, Any]], start: int
) -> SpeechPrompt | None:
    """The prompt rules of `configs` (generation_config.json, config.json), the decoder
    starting from `start` (their `decoder_start_token_id`); None where they are not a
    Whisper's (no `no_timestamps_token_id` nor `lang_to_id`)."""
    generation, hf_config = configs
    if "no_timestamps_token_id" not in generation and "lang_to_id" not in generation:
        return None
    languages = {
        str(token).removeprefix("<|").removesuffix("|>"): _id(value, "lang_to_id")
        for token, value in _table(generation, "lang_to_id").items()
    }
    tasks = {str(k): _id(v, "task_to_id") for k, v in _table(generation, "task_to_id").items()}
    forced = generation.get("forced_decoder_ids")
    if forced is None:
        forced = hf_config.get("forced_decoder_ids")
    language, task = generation.get("language"), generation.get("task")
    return SpeechPrompt(
        start,
        languages,
        tasks,
        _forced(forced),
        whole_number(generation.get("no_timestamps_token_id")),
        language if isinstance(language, str) else None,
        task if isinstance(task, str) else None,
    )


def _put_language(ids: list[int | None], language: int | None) -> None:
    if len(ids) > 1:
        ids[1] = language
    else:
        ids.append(language)


def _table(config: dict[str, Any], key: str) -> dict[str, Any]:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise ModelLoadError(f"generation_config.json: {key} is not a table")
    return value


def _id(value: Any, key: str) -> int:
    number = whole_number(value)
    if number is None or number < 0:
        raise ModelLoadError(f"generation_config.json: {key} holds {value!r}, not a token id")
    return number


def _forced(value: Any) -> tuple[int | None, ...]:
    """`forced_decoder_ids` (`[[position, id or null], ...]`): the ids at positions 1, 2, ...
    in a row, as `generate` takes them."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 for pair in value
    ):
        raise ModelLoadError("generation_config.json: forced_decoder_ids is not [[position, id]]")
    taken: list[int | None] = []
    for position, token in value:
        if whole_number(position) != len(taken) + 1:
            break
        taken.append(None if token is None else _id(token, "forced_decoder_ids"))
    return tuple(taken)
