"""Text in for a model that reads token ids: a request's `prompt` made into the model's inputs.

A version folder with a Hugging Face `tokenizer.json` whose model takes an integer `input_ids`
(optimum's `text-classification`, `token-classification`, `feature-extraction` exports, a
`torch.onnx.export` of a `transformers` encoder) may be sent `inputs: {prompt: TEXT}`, or a
`tensor(string)` of texts to run as one batch. Each text is cut as `transformers` cuts it (the
`tokenizers` library, special tokens added); the rows are padded to the longest, or to the
sequence length the signature fixes, with the tokenizer's pad token, on the side its
`tokenizer_config.json` says (right by default). A request may add `inputs.pair`, a second
text for each (a cross-encoder's passage for its query; one `prompt` goes with every `pair`):
each row is then the two joined by the tokenizer's pair template (`[CLS] A [SEP] B [SEP]`,
the second text's `token_type_ids` 1), as `tokenizer(text, text_pair)` joins them. The
model's `attention_mask`, `token_type_ids` and `position_ids` inputs, where it has them, are
made to match, as the tokenizer and the model would make them. A text longer than the model
can take (its fixed sequence length, or `config.json`'s context) is refused, never cut short.

Requests queued together for a model with `[batching]` share a run when their inputs join; rows
made from texts of different lengths join once padded to the longest (`TextInputs.padded`,
`agent.inference.texts.pad_to_join`), where the rows are padded on the right and the model's
outputs say which of them have a token axis to cut back (`token_outputs`).

A generate model has its own loop (`agent.models.decoder_layout`) and is not served here.
Imports only `backends.base`, `hf_files` and `tokenizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.models.backends.base import Array, ModelLoadError, TensorSpec
from agent.models.hf_files import context_of, read_json, special_token, whole_number
from agent.models.tokenizer import (
    TOKENIZER_FILE,
    Encoded,
    TextCodec,
    open_tokenizer,
    tokenizers_installed,
    too_long,
)

__all__ = [
    "PAIR_INPUT",
    "TEXT_INPUT",
    "TextBatch",
    "TextInputs",
    "TextRefused",
    "open_text_inputs",
    "per_text_rows",
    "token_outputs_of",
]

TEXT_INPUT = "prompt"  # the request's input that carries text (as for a generate model)
PAIR_INPUT = "pair"  # a second text for each of the prompt's (`tokenizer(text, text_pair)`)
MAX_TEXTS = 1024  # rows of one request's batch of texts

log = logging.getLogger(__name__)


class TextRefused(ValueError):
    """A request's text that cannot be made into the model's inputs (the message says why)."""


@dataclass(frozen=True)
class TextBatch:
    """A request's texts as they went in: each one's tokens, and where its first token is in
    its row of the inputs (after any left padding). Post-processing that names words (the
    `entities` op) reads them."""

    codec: TextCodec
    texts: tuple[str, ...]
    encoded: tuple[Encoded, ...]
    firsts: tuple[int, ...]
    pairs: tuple[str, ...] | None = None  # `inputs.pair`: each row's second text


@dataclass(frozen=True)
class TextInputs:
    """How a version's texts become its inputs."""

    codec: TextCodec
    ids: TensorSpec
    mask: TensorSpec | None
    types: TensorSpec | None
    positions: TensorSpec | None
    pad_id: int
    pad_left: bool
    fixed: int | None  # the sequence length the signature fixes: every row is padded to it
    longest: int | None  # the most tokens a text may have; None: no bound known
    # The outputs with the sequence on their axis 1, where every output's other axes are
    # known (fixed, or the batch): requests of different lengths may then share a run, padded
    # (`padded`) and their token outputs cut back. None: they may not.
    token_outputs: frozenset[str] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The model's inputs the texts give."""
        specs = (self.ids, self.mask, self.types, self.positions)
        return tuple(spec.name for spec in specs if spec is not None)

    def inputs(self, value: Any, pair: Any = None) -> tuple[dict[str, Array], TextBatch]:
        """The model's inputs for `value` (one text, or a string tensor of them: one row
        each) and `pair` (None, or each row's second text), and how each text was cut;
        TextRefused says what is wrong with them."""
        texts = _texts(value, TEXT_INPUT)
        pairs = _pairs(texts, pair)
        if pairs is not None and len(texts) == 1:
            texts = texts * len(pairs)  # one query for every passage
        for name, each in ((TEXT_INPUT, texts), (PAIR_INPUT, pairs or [])):
            for text in each:
                problem = too_long(text, self.longest)
                if problem is not None:
                    raise TextRefused(f"inputs.{name} {problem}")
        seconds: list[str | None] = list(pairs) if pairs is not None else [None] * len(texts)
        encoded = [self.codec.encode_text(t, p) for t, p in zip(texts, seconds, strict=True)]
        longest = max(len(e.ids) for e in encoded)
        if self.longest is not None and longest > self.longest:
            what = f"{TEXT_INPUT} is" if pairs is None else f"{TEXT_INPUT} and its pair are"
            raise TextRefused(
                f"inputs.{what} {longest} tokens: the model takes at most {self.longest}"
            )
        width = self.fixed if self.fixed is not None else longest
        ids = np.full((len(encoded), width), self.pad_id, dtype=self.ids.dtype)
        mask = np.zeros((len(encoded), width), dtype=np.int64)
        types = np.zeros((len(encoded), width), dtype=np.int64)
        firsts = []
        for row, cut in enumerate(encoded):
            first = width - len(cut.ids) if self.pad_left else 0
            where = slice(first, first + len(cut.ids))
            ids[row, where] = cut.ids
            mask[row, where] = 1
            types[row, where] = cut.type_ids
            firsts.append(first)
        paired = tuple(pairs) if pairs is not None else None
        batch = TextBatch(self.codec, tuple(texts), tuple(encoded), tuple(firsts), paired)
        made = {self.ids.name: ids}
        if self.mask is not None:
            made[self.mask.name] = mask.astype(self.mask.dtype, copy=False)
        if self.types is not None:
            made[self.types.name] = types.astype(self.types.dtype, copy=False)
        if self.positions is not None:  # as the model makes them when none are given
            positions = np.broadcast_to(np.arange(width), (len(encoded), width))
            made[self.positions.name] = positions.astype(self.positions.dtype)
        return made, batch

    @property
    def joins_lengths(self) -> bool:
        """Whether requests of different lengths may share a run: rows padded on the right
        (left padding would move each text's tokens), outputs whose token axis is known."""
        return self.token_outputs is not None and not self.pad_left and self.fixed is None

    def padded(self, made: dict[str, Array], width: int) -> dict[str, Array]:
        """`made` (this version's token inputs, with others) padded on the right to `width`
        tokens: the pad token, masked out, of type 0; positions go on counting."""
        result = dict(made)
        for spec in (self.ids, self.mask, self.types):
            if spec is not None and spec.name in made:
                value = made[spec.name]
                fill = self.pad_id if spec is self.ids else 0
                extra = np.full((value.shape[0], width - value.shape[1]), fill, dtype=value.dtype)
                result[spec.name] = np.concatenate([value, extra], axis=1)
        if self.positions is not None and self.positions.name in made:
            rows, dtype = made[self.positions.name].shape[0], made[self.positions.name].dtype
            positions = np.broadcast_to(np.arange(width, dtype=dtype), (rows, width))
            result[self.positions.name] = positions
        return result


def token_outputs_of(ids: TensorSpec, outputs: Sequence[TensorSpec]) -> frozenset[str] | None:
    """The outputs whose axis 1 is `input_ids`' sequence (the same symbolic name), where every
    other axis after the batch is fixed; None where an output has an axis not known so."""
    sequence = ids.shape[1] if len(ids.shape) == 2 else None
    if not isinstance(sequence, str):
        return None
    found = set()
    for spec in outputs:
        for axis, dim in enumerate(spec.shape[1:], start=1):
            if axis == 1 and dim == sequence:
                found.add(spec.name)
            elif not isinstance(dim, int):
                return None
    return frozenset(found)


def per_text_rows(
    op: str, output: str, outputs: dict[str, Any], texts: TextBatch | None, last: str
) -> tuple[Array, TextBatch]:
    """`outputs[output]` as float32 `[texts, sequence, last]`, a row a text of the request, and
    the texts; ValueError naming the op where the request sent token ids, not text, or the
    output's rows are not its texts."""
    if texts is None:
        raise ValueError(
            f"{op}: {output} is read with the request's text: send inputs.{TEXT_INPUT}, "
            "not token ids"
        )
    if texts.pairs is not None:
        raise ValueError(
            f"{op}: {output} is read one text a row: send inputs.{TEXT_INPUT} without "
            f"inputs.{PAIR_INPUT}"
        )
    rows: Array = np.asarray(outputs[output], dtype=np.float32)
    if rows.ndim != 3 or rows.shape[0] != len(texts.texts):
        raise ValueError(
            f"{op}: {output} has shape {list(rows.shape)}, expected "
            f"[{len(texts.texts)}, sequence, {last}]"
        )
    return rows, texts


def _texts(value: Any, name: str) -> list[str]:
    """The texts of a request's `prompt` (or `pair`): one text, or a string tensor [n]."""
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "OU" or value.ndim > 1:
        raise TextRefused(f"inputs.{name} must be a text, or a string tensor [n] of texts")
    texts: list[Any] = value.reshape(-1).tolist()
    if not texts:
        raise TextRefused(f"inputs.{name} holds no text")
    if len(texts) > MAX_TEXTS:
        raise TextRefused(f"inputs.{name} holds {len(texts)} texts: at most {MAX_TEXTS}")
    if not all(isinstance(text, str) for text in texts):
        raise TextRefused(f"inputs.{name} must hold texts")
    return texts


def _pairs(texts: list[str], value: Any) -> list[str] | None:
    """The second texts of a request's rows (`pair`): as many as the prompt's texts, or any
    number beside one prompt; None where it sent none."""
    if value is None:
        return None
    pairs = _texts(value, PAIR_INPUT)
    if len(texts) not in (1, len(pairs)):
        raise TextRefused(
            f"inputs.{PAIR_INPUT} holds {len(pairs)} texts and inputs.{TEXT_INPUT} "
            f"{len(texts)}: send as many, or one {TEXT_INPUT} for all"
        )
    return pairs


def open_text_inputs(
    specs: Sequence[TensorSpec], folder: Path, outputs: Sequence[TensorSpec] | None = None
) -> TextInputs | None:
    """How `folder`'s tokenizer feeds a model of inputs `specs` (and `outputs`, where known:
    whether requests of different lengths may share a run); None where the folder has no
    `tokenizer.json`, the model takes no integer `input_ids`, it has an input named `prompt`
    of its own, or the `tokenizers` library is not installed (a warning says so);
    ModelLoadError where the files cannot be read."""
    by_name = {spec.name: spec for spec in specs}
    ids = by_name.get("input_ids")
    if ids is None or ids.dtype.kind not in "iu" or TEXT_INPUT in by_name:
        return None
    if not (folder / TOKENIZER_FILE).is_file():
        return None
    if not tokenizers_installed():  # it served token ids before the extra existed: it still does
        log.warning(
            "%s has a %s: install the 'text' extra (pip install 'edge-stream-agent[text]') "
            "for requests to send text; it takes token ids meanwhile",
            folder,
            TOKENIZER_FILE,
        )
        return None
    codec = open_tokenizer(folder)
    if codec is None:
        return None
    if len(ids.shape) != 2:
        raise ModelLoadError(
            f"a tokenizer.json beside a model whose input_ids is {list(ids.shape)}: "
            "text is made into [batch, sequence]"
        )
    hf_config = read_json(folder / "config.json")
    tokenizer_config = read_json(folder / "tokenizer_config.json")
    fixed = ids.shape[1] if isinstance(ids.shape[1], int) and ids.shape[1] > 0 else None
    bounds = [b for b in (fixed, context_of(hf_config)) if b is not None]
    return TextInputs(
        codec,
        ids,
        by_name.get("attention_mask"),
        by_name.get("token_type_ids"),
        by_name.get("position_ids"),
        _pad_id(codec, hf_config, tokenizer_config),
        tokenizer_config.get("padding_side") == "left",
        fixed,
        min(bounds) if bounds else None,
        token_outputs_of(ids, outputs) if outputs is not None else None,
    )


def _pad_id(codec: TextCodec, hf_config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int:
    """The tokenizer's pad token (`tokenizer_config.json`), else `config.json`'s
    `pad_token_id`, else 0: what pads a row is masked out, so only a model that reads its
    pad positions tells them apart."""
    token = special_token(tokenizer_config.get("pad_token"))
    found = codec.token_id(token) if token is not None else None
    if found is None:
        found = whole_number(hf_config.get("pad_token_id"))
    return found if found is not None and found >= 0 else 0
