"""ONNX Runtime GenAI's `genai_config.json`, read where a version folder holds one.

ONNX Runtime GenAI's model builder (`python -m onnxruntime_genai.models.builder`, also run by
Olive) writes a decoder, its tokenizer's files and `genai_config.json` instead of Hugging
Face's `config.json` and `generation_config.json`; Microsoft's published ONNX language models
(the Phi-3 and Phi-4-mini `*-onnx` folders) are such folders. The file says what those two
would: the eos, pad and bos ids and the context length (`model`), the decoder's file and tensor
names (`model.decoder`), and the search's settings (`search`: beams, minimum length, n-grams,
penalties, sampling by default). :func:`read_genai_config` turns it into the two Hugging Face
files' keys, so the rest of the agent reads one vocabulary; a folder that also holds the
Hugging Face files reads those first (`agent.models.decoder_layout`).

Only a decoder alone is read: a config of several models (a vision or speech encoder, an
embedding model before the decoder) is refused, as is a cache named otherwise than
`past_key_values.%d.key` / `present.%d.key`. `past_present_share_buffer` is the GenAI
runtime's own memory plan (one buffer of the whole context); the agent grows the cache a step
at a time, which the builder's models take as well.

Imports only `backends.base` and `hf_files`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from agent.models.backends.base import ModelLoadError
from agent.models.hf_files import read_json, whole_number

__all__ = ["GENAI_CONFIG", "GenaiConfig", "decoder_file_of", "read_genai_config"]

GENAI_CONFIG = "genai_config.json"
# The cache's names, as the layout reads them (`%d`: the layer).
CACHE_NAMES = {
    "past_key_names": "past_key_values.%d.key",
    "past_value_names": "past_key_values.%d.value",
    "present_key_names": "present.%d.key",
    "present_value_names": "present.%d.value",
}
# The decoder's tensors `[generate]` may also name: genai's key -> GenerateConfig's field.
TENSOR_NAMES = {
    "input_ids": "input_ids",
    "attention_mask": "attention_mask",
    "position_ids": "position_ids",
    "logits": "logits",
}
# `search` keys with the same meaning in generation_config.json (the ones the agent applies or
# warns about, `agent.models.token_settings`).
SEARCH_KEYS = (
    "num_beams",
    "min_length",
    "no_repeat_ngram_size",
    "repetition_penalty",
    "length_penalty",
    "early_stopping",
    "do_sample",
    "num_return_sequences",
)
MODEL_KEYS = ("eos_token_id", "pad_token_id", "bos_token_id", "vocab_size")
# Parts of a config of several models, which the agent does not run as one decoder.
OTHER_MODELS = ("encoder", "vision", "speech", "embedding")


@dataclass(frozen=True)
class GenaiConfig:
    """What `genai_config.json` says, in Hugging Face's keys."""

    hf_config: dict[str, Any] = field(default_factory=dict)  # as config.json would
    generation_config: dict[str, Any] = field(default_factory=dict)  # as generation_config.json
    names: dict[str, str] = field(default_factory=dict)  # GenerateConfig field -> tensor name


def read_genai_config(folder: Path) -> GenaiConfig:
    """The folder's `genai_config.json`, empty where it has none (ModelLoadError, naming the
    file, where it is unreadable or describes what the agent does not run)."""
    data = read_json(folder / GENAI_CONFIG)
    if not data:
        return GenaiConfig()
    model = _table(data, "model")
    decoder = _table(model, "decoder")
    others = [part for part in OTHER_MODELS if part in model]
    if others:
        raise ModelLoadError(
            f"{GENAI_CONFIG} describes a pipeline of several models ({', '.join(others)} "
            "before the decoder); the agent runs a decoder alone"
        )
    hf_config = {key: model[key] for key in MODEL_KEYS if key in model}
    context = whole_number(model.get("context_length"))
    if context is not None and context > 0:
        hf_config["max_position_embeddings"] = context
    search = _table(data, "search")
    generation = {key: search[key] for key in SEARCH_KEYS if key in search}
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if key in model:
            generation[key] = model[key]
    return GenaiConfig(hf_config, generation, _tensor_names(decoder))


def decoder_file_of(folder: Path) -> str | None:
    """The decoder's file name that the folder's `genai_config.json` gives (a plain name in
    the folder, ending `.onnx`), None where there is no such file (ModelLoadError where the
    config is unreadable or names a file elsewhere)."""
    data = read_json(folder / GENAI_CONFIG)
    if not data:
        return None
    name = _table(_table(data, "model"), "decoder").get("filename")
    if name is None:
        return None
    path = PurePosixPath(str(name))
    if not isinstance(name, str) or path.name != name or path.suffix != ".onnx":
        raise ModelLoadError(
            f"{GENAI_CONFIG}: model.decoder.filename {name!r} is not an .onnx file's name in "
            "the version folder"
        )
    return name


def _tensor_names(decoder: dict[str, Any]) -> dict[str, str]:
    """The decoder's tensor names that differ from the layout's own (`TENSOR_NAMES`'
    fields), after checking the cache's names are the layout's."""
    inputs, outputs = _table(decoder, "inputs"), _table(decoder, "outputs")
    given = {**inputs, **outputs}
    for key, expected in CACHE_NAMES.items():
        if given.get(key, expected) != expected:
            raise ModelLoadError(
                f"{GENAI_CONFIG}: the cache is named {given[key]!r} ({key}); the agent reads "
                "past_key_values.%d.key/value in and present.%d.key/value out"
            )
    names = {}
    for key, field_name in TENSOR_NAMES.items():
        name = given.get(key)
        if name is not None and not isinstance(name, str):
            raise ModelLoadError(f"{GENAI_CONFIG}: the decoder's {key} is not a name")
        if name is not None and name != key:
            names[field_name] = name
    return names


def _table(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ModelLoadError(f"{GENAI_CONFIG}: {key} is not a table")
    return value
