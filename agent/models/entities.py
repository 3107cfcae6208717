"""The `entities` post-processing op: a token classifier's logits as the named entities of the
request's text, as Hugging Face's `pipeline("token-classification", aggregation_strategy=...)`
gives them.

A token classifier (optimum's `token-classification` export: NER, part-of-speech) outputs
`[batch, sequence, labels]`: a score for every label at every token. Read alone, those say
nothing to a backend that has not got the version's tokenizer: which token is which word, and
where in the text. The op needs the request's text (`inputs.prompt`, tokenized by the agent:
`agent.models.text_inputs.TextBatch`) and, per row, does what the pipeline's
`gather_pre_entities`, `aggregate` and `group_entities` do:

- each token the tokenizer did not add gets the softmax of its logits; a token that is the
  unknown token takes the text it stands for;
- `aggregation = "none"`: each token is `{entity, score, index, word, start, end}` (its best
  label, that label's probability, its place in the model's row, its token, its characters);
- `"simple"` (the default): consecutive tokens whose labels share a tag (`B-PER`, `I-PER`:
  `PER`; a label without a `B-`/`I-` prefix is its own tag) make one entity, a `B-` label
  starting a new one;
- `"first"`, `"average"`, `"max"`: tokens are first joined into words, and each word takes
  one label: its first token's, the best of its tokens' mean scores, or that of its most
  confident token; the words are then grouped as `"simple"` groups tokens. A token continues
  a word where the tokenizer marks its pieces (WordPiece's `##`: the token is longer than the
  text it covers); for a tokenizer that does not (byte-level BPE), where no space is at or
  before its first character, the pipeline's own fallback;
- an entity is `{entity_group, score, word, start, end}`: its first label after the first
  `-` (the tag), the mean of its members' probabilities, its members joined by the
  tokenizer's decoder, and its characters `[start, end)` in the text; entities of `O` are
  left out.

The op replaces the output by `entities`: a list per text of such maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from agent.models.text_inputs import TextBatch, per_text_rows

__all__ = ["AGGREGATIONS", "Aggregation", "EntitiesSpec", "decode_entities"]

OUTSIDE = "O"  # the label of a token in no entity (the pipeline's ignore_labels)
Aggregation = Literal["none", "simple", "first", "average", "max"]
AGGREGATIONS: tuple[Aggregation, ...] = ("none", "simple", "first", "average", "max")


@dataclass(frozen=True)
class EntitiesSpec:
    """One `entities` op, checked at load (agent.models.postprocess)."""

    output: str
    labels: tuple[str, ...]
    aggregation: Aggregation = "simple"


@dataclass
class _Token:
    """A token, or (the word strategies) a word: its best label and what it covers."""

    label: str
    score: float
    word: str
    start: int
    end: int
    scores: np.ndarray[Any, Any]  # the softmax over the labels
    index: int = 0  # its place in the model's row
    continues: bool = False  # a piece of the word before it


def decode_entities(
    spec: EntitiesSpec, outputs: dict[str, Any], texts: TextBatch | None
) -> dict[str, Any]:
    """`outputs` with the classifier's logits replaced by `entities`; ValueError where the
    request sent no text or the output is not `[texts, sequence, labels]`."""
    logits, texts = per_text_rows("entities", spec.output, outputs, texts, "labels")
    if logits.shape[2] != len(spec.labels):
        raise ValueError(
            f"entities: {spec.output} has {logits.shape[2]} labels; the labels file names "
            f"{len(spec.labels)}"
        )
    shifted = np.exp(logits - logits.max(axis=2, keepdims=True))
    probabilities = shifted / shifted.sum(axis=2, keepdims=True)
    rows = [_row_entities(spec, texts, row, probabilities[row]) for row in range(len(logits))]
    result = {k: v for k, v in outputs.items() if k != spec.output}
    result["entities"] = rows
    return result


def _row_entities(
    spec: EntitiesSpec, texts: TextBatch, row: int, probabilities: np.ndarray[Any, Any]
) -> list[dict[str, Any]]:
    tokens = _tokens(spec, texts, row, probabilities)
    if spec.aggregation == "none":
        return [_token_entity(token) for token in tokens if token.label != OUTSIDE]
    if spec.aggregation != "simple":
        tokens = [_word(spec, texts, word) for word in _words(tokens)]
    entities = [_entity(texts, group) for group in _groups(tokens)]
    return [entity for entity in entities if entity["entity_group"] != OUTSIDE]


def _tokens(
    spec: EntitiesSpec, texts: TextBatch, row: int, probabilities: np.ndarray[Any, Any]
) -> list[_Token]:
    """The row's tokens that the tokenizer did not add, each with its best label."""
    text, cut, first = texts.texts[row], texts.encoded[row], texts.firsts[row]
    codec = texts.codec
    unknown, marked = codec.unknown_id, codec.marks_word_pieces
    tokens = []
    for i, token_id in enumerate(cut.ids):
        if cut.special[i]:
            continue
        scores = probabilities[first + i]
        best = int(scores.argmax())
        start, end = cut.offsets[i]
        word = codec.token(token_id)
        if marked:
            continues = len(word) != end - start
        else:  # the pipeline's fallback: no space at or just before the token
            continues = start > 0 and " " not in text[start - 1 : start + 1]
        if token_id == unknown:
            word, continues = text[start:end], False
        label, score = spec.labels[best], float(scores[best])
        tokens.append(_Token(label, score, word, start, end, scores, i, continues))
    return tokens


def _token_entity(token: _Token) -> dict[str, Any]:
    """`aggregation = "none"`: one token as the pipeline gives it."""
    return {
        "entity": token.label,
        "score": token.score,
        "index": token.index,
        "word": token.word,
        "start": token.start,
        "end": token.end,
    }


def _words(tokens: list[_Token]) -> list[list[_Token]]:
    """Tokens in words: a token that continues a word joins the word before it."""
    words: list[list[_Token]] = []
    for token in tokens:
        if words and token.continues:
            words[-1].append(token)
        else:
            words.append([token])
    return words


def _word(spec: EntitiesSpec, texts: TextBatch, pieces: list[_Token]) -> _Token:
    """One word's label and score, by the spec's strategy (`aggregate_word`)."""
    if spec.aggregation == "first":
        scores = pieces[0].scores
    elif spec.aggregation == "max":
        scores = max(pieces, key=lambda piece: float(piece.scores.max())).scores
    else:  # "average"
        scores = np.mean(np.stack([piece.scores for piece in pieces]), axis=0)
    best = int(scores.argmax())
    word = texts.codec.joined([piece.word for piece in pieces])
    return _Token(
        spec.labels[best], float(scores[best]), word, pieces[0].start, pieces[-1].end, scores
    )


def _tag(token: _Token) -> tuple[str, str]:
    """(`B` or `I`, the tag): `B-PER` is ("B", "PER"); a label without a prefix continues."""
    if token.label.startswith(("B-", "I-")):
        return token.label[0], token.label[2:]
    return "I", token.label


def _groups(tokens: list[_Token]) -> list[list[_Token]]:
    """Runs of tokens of one tag, each `B-` starting a new run."""
    groups: list[list[_Token]] = []
    for token in tokens:
        begins, tag = _tag(token)
        if groups and tag == _tag(groups[-1][-1])[1] and begins != "B":
            groups[-1].append(token)
        else:
            groups.append([token])
    return groups


def _entity(texts: TextBatch, group: list[_Token]) -> dict[str, Any]:
    return {
        "entity_group": group[0].label.split("-", 1)[-1],  # as the pipeline names a group
        "score": float(np.mean([token.score for token in group])),
        "word": texts.codec.joined([token.word for token in group]),
        "start": group[0].start,
        "end": group[-1].end,
    }
