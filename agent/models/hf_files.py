"""The Hugging Face JSON files a version folder may hold beside its model, read bounded.

`save_pretrained` and optimum's exporters leave `config.json` (the architecture: context
length, pad and eos ids, `id2label`), `generation_config.json` and `tokenizer_config.json` in
the folder they export to. The agent reads what it needs from them: a generate model's eos ids
and context (`agent.models.decoder_layout`), a text model's pad token and longest input
(`agent.models.text_inputs`), a classifier's labels (`agent.models.postprocess`).

Imports only `backends.base` and `text_file`, so any module of `agent.models` may use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent.models.backends.base import ModelLoadError
from agent.models.text_file import read_text_limited

__all__ = [
    "MAX_JSON_BYTES",
    "context_of",
    "model_max_length",
    "read_json",
    "read_text",
    "special_token",
    "whole_number",
]

MAX_JSON_BYTES = 1024 * 1024
# Where configs of the architectures `transformers` knows keep their longest input.
# The last: a Whisper's decoder (its encoder's positions are its 30 s window's).
_CONTEXT_KEYS = (
    "n_positions",
    "max_position_embeddings",
    "n_ctx",
    "max_sequence_length",
    "max_seq_len",  # MPT's
    "max_target_positions",
)


def read_text(path: Path, limit: int) -> str:
    """The UTF-8 text of the version folder's file `path`, its size bounded by `limit`
    (ModelLoadError, naming the file, where it is larger, unreadable or not text)."""

    def unreadable(e: Exception) -> ModelLoadError:
        return ModelLoadError(f"{path.name} cannot be read: {e}")

    return read_text_limited(
        path,
        limit,
        too_large=lambda _: ModelLoadError(f"{path.name} is larger than {limit} bytes"),
        cannot_read=unreadable,
        not_text=unreadable,
    )


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} where there is no such file (ModelLoadError where it is
    too large, unreadable or not a JSON object)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text(path, MAX_JSON_BYTES))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path.name} cannot be read: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} is not a JSON object")
    return data


def whole_number(value: Any) -> int | None:
    """`value` where it is a JSON integer (not a boolean), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def special_token(value: Any) -> str | None:
    """A special token as a tokenizer's config writes it: a text, or (older files) an
    AddedToken's fields, whose `content` is the text; None for anything else."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def model_max_length(tokenizer_config: dict[str, Any]) -> int | None:
    """A `tokenizer_config.json`'s `model_max_length`, where it is a real bound:
    `transformers` writes a huge number (1e30) for a model it knows none of."""
    value = whole_number(tokenizer_config.get("model_max_length"))
    return value if value is not None and 0 < value < 10**9 else None


def context_of(config: dict[str, Any]) -> int | None:
    """The longest input (tokens) a `config.json` gives, None where it gives none."""
    for key in _CONTEXT_KEYS:
        value = whole_number(config.get(key))
        if value is not None and value > 0:
            return value
    return None


# Families whose positions are ALiBi biases made inside the graph, unchanged by padding on the
# left (Bloom's from the attention mask; MPT's from key distances, where the padding is masked):
# their exports take no `position_ids`, and need none to run rows of different lengths together.
ALIBI_FAMILIES = frozenset({"bloom", "mpt"})


def alibi_positions(config: dict[str, Any]) -> bool:
    """Whether `config.json` names a family of `ALIBI_FAMILIES`."""
    return config.get("model_type") in ALIBI_FAMILIES
