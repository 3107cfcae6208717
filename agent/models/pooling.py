"""The `pool` post-processing op: an encoder's hidden states as one embedding a text.

An encoder exported for `feature-extraction` (optimum, `transformers` library) outputs
`last_hidden_state [texts, sequence, hidden]`, a vector a token; an embedding model's card
then says how to make one vector a text: the mean of its tokens' vectors (sentence-transformers'
`Pooling("mean")`: MiniLM, E5) or its first token's, `[CLS]` (BGE), usually L2-normalised.
The op does that on the box, over each text's own tokens as the request's `prompt` was cut
(`agent.models.text_inputs.TextBatch`: padding left out, left or right), and replaces the
output by `sentence_embedding` float32 `[texts, hidden]`, the name optimum gives a
sentence-transformers export's pooled output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.models.text_inputs import TextBatch, per_text_rows

__all__ = ["POOLED", "PoolSpec", "pool_texts"]

POOLED = "sentence_embedding"
_EPSILON = np.float32(1e-12)  # torch.nn.functional.normalize's


@dataclass(frozen=True)
class PoolSpec:
    """One `pool` op, checked at load (agent.models.postprocess)."""

    output: str
    method: str  # "mean" | "cls"
    normalize: bool


def pool_texts(spec: PoolSpec, outputs: dict[str, Any], texts: TextBatch | None) -> dict[str, Any]:
    """`outputs` with the hidden states replaced by one embedding a text; ValueError where
    the request sent no text or the output is not `[texts, sequence, hidden]`."""
    hidden, texts = per_text_rows("pool", spec.output, outputs, texts, "hidden")
    rows = []
    for row, (cut, first) in enumerate(zip(texts.encoded, texts.firsts, strict=True)):
        tokens = hidden[row, first : first + len(cut.ids)]
        rows.append(tokens.mean(axis=0) if spec.method == "mean" else tokens[0])
    pooled = np.stack(rows).astype(np.float32, copy=False)
    if spec.normalize:
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), _EPSILON)
    result = {k: v for k, v in outputs.items() if k != spec.output}
    result[POOLED] = pooled
    return result
