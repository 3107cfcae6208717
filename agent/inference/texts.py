"""Text inputs of a request: a `prompt` made into the token inputs of a model that reads them.

For a version with a tokenizer (`LoadedVersion.text`, `agent.models.text_inputs`), a request
may send `inputs.prompt` (one text, or a string tensor of texts), and with it `inputs.pair`
(each row's second text), in place of `input_ids` and its companions. Here, where the request
runs (a worker, or the network thread for a short run), the texts are tokenized; the time goes
to the reply's `timing` as `tokenize_ms`, and the inputs are then checked as any others are.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.inference.job import Job
from agent.inference.modes import Member
from agent.models.backends.base import TensorSpec
from agent.models.manager import LoadedVersion
from agent.models.text_inputs import PAIR_INPUT, TEXT_INPUT, TextInputs, TextRefused
from agent.protocol.errors import WireError

__all__ = ["pad_to_join", "refuse_negative_ids", "refuse_untaken_text", "tokenized_inputs"]


def tokenized_inputs(job: Job, loaded: LoadedVersion) -> Mapping[str, Any]:
    """The request's inputs, its `prompt` (where it sent one to a model with a tokenizer)
    replaced by the model's token inputs; `bad_request` where it cannot be."""
    inputs = job.request.inputs
    text = loaded.text
    if text is None or TEXT_INPUT not in inputs:
        refuse_untaken_text(inputs, text is not None, loaded.session.inputs, job.request.id)
        return inputs
    both = [name for name in text.names if name in inputs]
    if both:
        raise WireError(
            "bad_request",
            f"inputs.{TEXT_INPUT} makes {', '.join(both)}: send the text or the tokens, not both",
            job.request.id,
        )
    started = time.perf_counter()
    try:
        made, job.texts = text.inputs(inputs[TEXT_INPUT], inputs.get(PAIR_INPUT))
    except TextRefused as e:
        raise WireError("bad_request", str(e), job.request.id) from None
    job.timing["tokenize_ms"] = round((time.perf_counter() - started) * 1000, 3)
    rest = {name: value for name, value in inputs.items() if name not in (TEXT_INPUT, PAIR_INPUT)}
    return {**rest, **made}


def refuse_negative_ids(
    inputs: Mapping[str, Any], token_ids: str | None, request_id: str | None
) -> None:
    """Token ids sent as they are to a model with a tokenizer are never negative: ONNX
    Runtime's Gather takes -1 as the vocabulary's last entry, a silent wrong answer
    (`bad_request`). Past the vocabulary, the model's own run refuses them."""
    ids = inputs.get(token_ids) if token_ids is not None else None
    if isinstance(ids, np.ndarray) and ids.dtype.kind == "i" and ids.size and ids.min() < 0:
        raise WireError(
            "bad_request",
            f"inputs.{token_ids} holds {int(ids.min())}: token ids are not negative",
            request_id,
        )


def refuse_untaken_text(
    inputs: Mapping[str, Any],
    takes_text: bool,
    specs: Sequence[TensorSpec],
    request_id: str | None,
) -> None:
    """`bad_request`, with the reason rather than the inputs it misses, for text a version
    cannot take: a `prompt` or `pair` where it has no tokenizer (unless its model has an input
    of that name), a `pair` without the `prompt` it is the second text of."""
    if takes_text:
        if PAIR_INPUT in inputs and TEXT_INPUT not in inputs:
            raise WireError(
                "bad_request",
                f"inputs.{PAIR_INPUT} is the second text of inputs.{TEXT_INPUT}: send both",
                request_id,
            )
        return
    names = {spec.name for spec in specs}
    for name in (TEXT_INPUT, PAIR_INPUT):
        if name in inputs and name not in names:
            raise WireError(
                "bad_request",
                f"inputs.{name} (text) needs a tokenizer.json in the version folder, and "
                "this version has none: send the model's own inputs",
                request_id,
            )


def pad_to_join(members: Sequence[Member], jobs: Sequence[Job], text: TextInputs) -> None:
    """Members (of a `whole` model with `[batching]`) whose rows were made from texts of
    different lengths, padded to the longest so that they join one run; each padded member
    notes its own width, to which its token outputs are cut back (`modes.whole`)."""
    names = text.token_outputs
    if names is None or not text.joins_lengths:
        return
    made = [m for m, job in zip(members, jobs, strict=True) if job.texts is not None]
    if len(made) < 2:
        return
    widths = [int(m.inputs[text.ids.name].shape[1]) for m in made]
    width = max(widths)
    for member, own in zip(made, widths, strict=True):
        if own < width:
            member.inputs = text.padded(member.inputs, width)
            member.trim = (own, names)
