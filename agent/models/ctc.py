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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["CtcSpec", "decode_ctc"]

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class CtcSpec:
    """One `ctc` op, checked at load (agent.models.postprocess)."""

    output: str
    characters: tuple[str, ...]  # the classes but the blank, in order
    blank: int
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
        texts[row] = "".join(spec.table[best[row][chosen]])
        if chosen.any():
            scores[row] = confidence[row][chosen].mean()
    result = {k: v for k, v in outputs.items() if k != spec.output}
    result[f"{spec.output}_text"] = texts
    result[f"{spec.output}_score"] = scores
    return result
