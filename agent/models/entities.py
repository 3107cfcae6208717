"""The `entities` post-processing op: a token classifier's logits as the named entities of the
request's text, as Hugging Face's `pipeline("token-classification",
aggregation_strategy="simple")` gives them.

A token classifier (optimum's `token-classification` export: NER, part-of-speech) outputs
`[batch, sequence, labels]`: a score for every label at every token. Read alone, those say
nothing to a backend that has not got the version's tokenizer: which token is which word, and
where in the text. The op needs the request's text (`inputs.prompt`, tokenized by the agent:
`agent.models.text_inputs.TextBatch`) and, per row:

- each token the tokenizer did not add gets the softmax of its logits, its best label and that
  label's probability; a token that is the unknown token takes the text it stands for;
- consecutive tokens whose labels share a tag (`B-PER`, `I-PER`: `PER`; a label without a
  `B-`/`I-` prefix is its own tag) make one entity, a `B-` label starting a new one;
- an entity is `{entity_group, score, word, start, end}`: its first label after the first
  `-` (the tag), the mean of its tokens' probabilities, its tokens joined by the tokenizer's
  decoder, and its characters `[start, end)` in the text; entities of `O` are left out.

The op replaces the output by `entities`: a list per text of such maps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.models.text_inputs import TextBatch, per_text_rows

__all__ = ["EntitiesSpec", "decode_entities"]

OUTSIDE = "O"  # the label of a token in no entity (the pipeline's ignore_labels)


@dataclass(frozen=True)
class EntitiesSpec:
    """One `entities` op, checked at load (agent.models.postprocess)."""

    output: str
    labels: tuple[str, ...]


@dataclass
class _Token:
    label: str
    score: float
    word: str
    start: int
    end: int


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
    text, cut, first = texts.texts[row], texts.encoded[row], texts.firsts[row]
    unknown = texts.codec.unknown_id
    tokens = []
    for i, token_id in enumerate(cut.ids):
        if cut.special[i]:
            continue
        scores = probabilities[first + i]
        best = int(scores.argmax())
        start, end = cut.offsets[i]
        word = text[start:end] if token_id == unknown else texts.codec.token(token_id)
        tokens.append(_Token(spec.labels[best], float(scores[best]), word, start, end))
    entities = [_entity(texts, group) for group in _groups(tokens)]
    return [entity for entity in entities if entity["entity_group"] != OUTSIDE]


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
