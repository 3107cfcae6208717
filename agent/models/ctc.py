"""The `ctc` post-processing op: a text recogniser's per-step class probabilities as text.

A CTC recogniser (PaddleOCR's rec models, CRNNs) outputs ``[batch, steps, classes]``: at each
step of the image's width, a probability for every character and for the *blank*. Greedy
decoding, as PaddleOCR's ``CTCLabelDecode`` does it: the best class of each step; a step is
kept where its class is not the blank and differs from the step before; the kept classes'
characters joined are the text, and the mean of their probabilities its score (0 for an empty
text).

Classes map to characters in order, the blank left out: the ``labels`` file's lines (one
character or word a line, kept exactly, spaces included), then a space where ``space`` is set
(PaddleOCR's ``use_space_char``). With ``blank = 0`` (PaddleOCR, PyTorch's ``CTCLoss``) the
first label is class 1. The op replaces the output by ``NAME_text`` (a string tensor
``[batch]``) and ``NAME_score`` (float32 ``[batch]``): a few bytes instead of the probabilities.

With ``labels = "vocab.json"`` the classes are a Hugging Face CTC tokenizer's
(``Wav2Vec2CTCTokenizer``, as ``save_pretrained`` leaves it beside a wav2vec2 export) and the
text is what its ``decode`` of the best classes gives: the vocabulary's tokens by id, the pad
token the blank, the word delimiter (``|``) as its ``replace_word_delimiter_char``, the text
stripped, lower-cased where ``do_lower_case`` and cleaned up where
``clean_up_tokenization_spaces`` say so (``tokenizer_config.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.models.backends.base import ModelLoadError
from agent.models.hf_files import read_json, special_token

__all__ = ["HF_VOCAB", "CtcSpec", "decode_ctc", "hf_ctc_spec"]

HF_VOCAB = "vocab.json"  # `labels` naming it: a Hugging Face CTC tokenizer's vocabulary
# transformers' clean_up_tokenization: spaces before punctuation and English contractions
_CLEAN_UP: tuple[tuple[str, str], ...] = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class CtcSpec:
    """One `ctc` op, checked at load (agent.models.postprocess)."""

    output: str
    characters: tuple[str, ...]  # the classes but the blank, in order
    blank: int
    # A Hugging Face tokenizer's decode: the text stripped, lower-cased, cleaned up
    strip: bool = False
    lower: bool = False
    clean_up: bool = False
    # The character of each class (the blank's ""), as an object array, built once
    table: Array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        table = np.array([*self.characters[: self.blank], "", *self.characters[self.blank :]])
        object.__setattr__(self, "table", table.astype(object))


def decode_ctc(spec: CtcSpec, outputs: dict[str, Any]) -> dict[str, Any]:
    """`outputs` with the recogniser's probabilities replaced by `NAME_text` and
    `NAME_score`; ValueError where the output is not `[batch, steps, classes]` of the
    labels' classes."""
    probs = np.asarray(outputs[spec.output])
    if probs.ndim != 3:
        raise ValueError(
            f"ctc: {spec.output} has shape {list(probs.shape)}, expected [batch, steps, classes]"
        )
    if probs.shape[2] != len(spec.table):
        raise ValueError(
            f"ctc: {spec.output} has {probs.shape[2]} classes; the labels (and space) and the "
            f"blank make {len(spec.table)}"
        )
    best = probs.argmax(axis=2)
    confidence = probs.max(axis=2)
    kept = best != spec.blank
    kept[:, 1:] &= best[:, 1:] != best[:, :-1]
    texts = np.empty(len(best), dtype=object)
    scores = np.zeros(len(best), dtype=np.float32)
    for row in range(len(best)):
        chosen = kept[row]
        texts[row] = _finished("".join(spec.table[best[row][chosen]]), spec)
        if chosen.any():
            scores[row] = confidence[row][chosen].mean()
    result = {k: v for k, v in outputs.items() if k != spec.output}
    result[f"{spec.output}_text"] = texts
    result[f"{spec.output}_score"] = scores
    return result


def _finished(text: str, spec: CtcSpec) -> str:
    if spec.strip:
        text = text.strip()
    if spec.lower:
        text = text.lower()
    if spec.clean_up:
        for before, after in _CLEAN_UP:
            text = text.replace(before, after)
    return text


def hf_ctc_spec(output: str, folder: Path) -> CtcSpec:
    """The `ctc` op of `output` with the Hugging Face CTC tokenizer of `folder` (`vocab.json`,
    `tokenizer_config.json`, `special_tokens_map.json`); ModelLoadError where the vocabulary
    does not name classes 0 to n-1 or has no pad token."""
    vocab = read_json(folder / HF_VOCAB)
    by_id = {i: token for token, i in vocab.items() if isinstance(i, int)}
    if not vocab or sorted(by_id) != list(range(len(vocab))):
        raise ModelLoadError(f"postprocess ctc: {HF_VOCAB} must give the ids 0 to n-1, once each")
    config = {**read_json(folder / "special_tokens_map.json")}
    config |= read_json(folder / "tokenizer_config.json")
    pad = special_token(config.get("pad_token")) or "<pad>"
    if pad not in vocab:
        raise ModelLoadError(
            f"postprocess ctc: the pad token {pad!r} (the blank) is not in {HF_VOCAB}"
        )
    delimiter = special_token(config.get("word_delimiter_token")) or "|"
    replace = config.get("replace_word_delimiter_char", " ")
    replace = replace if isinstance(replace, str) else " "
    blank = vocab[pad]
    tokens = [replace if by_id[i] == delimiter else by_id[i] for i in range(len(by_id))]
    return CtcSpec(
        output,
        tuple(tokens[:blank] + tokens[blank + 1 :]),
        blank,
        strip=True,
        lower=config.get("do_lower_case") is True,
        clean_up=config.get("clean_up_tokenization_spaces") is True,
    )
