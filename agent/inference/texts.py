"""Text inputs of a request: a `prompt` made into the token inputs of a model that reads them.

For a version with a tokenizer (`LoadedVersion.text`, `agent.models.text_inputs`), a request
may send `inputs.prompt` (one text, or a string tensor of texts) in place of `input_ids` and
its companions. Here, where the request runs (a worker, or the network thread for a short
run), the texts are tokenized; the time goes to the reply's `timing` as `tokenize_ms`, and the
inputs are then checked as any others are.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from agent.inference.job import Job
from agent.models.backends.base import TensorSpec
from agent.models.manager import LoadedVersion
from agent.models.text_inputs import TEXT_INPUT, TextRefused
from agent.protocol.errors import WireError

__all__ = ["refuse_untokenized", "tokenized_inputs"]


def tokenized_inputs(job: Job, loaded: LoadedVersion) -> Mapping[str, Any]:
    """The request's inputs, its `prompt` (where it sent one to a model with a tokenizer)
    replaced by the model's token inputs; `bad_request` where it cannot be."""
    inputs = job.request.inputs
    text = loaded.text
    if text is None or TEXT_INPUT not in inputs:
        refuse_untokenized(inputs, loaded.session.inputs, job.request.id)
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
        made, job.texts = text.inputs(inputs[TEXT_INPUT])
    except TextRefused as e:
        raise WireError("bad_request", str(e), job.request.id) from None
    job.timing["tokenize_ms"] = round((time.perf_counter() - started) * 1000, 3)
    rest = {name: value for name, value in inputs.items() if name != TEXT_INPUT}
    return {**rest, **made}


def refuse_untokenized(
    inputs: Mapping[str, Any], specs: Sequence[TensorSpec], request_id: str | None
) -> None:
    """`bad_request` for a `prompt` sent to a version with no tokenizer (unless its model has
    an input of that name): the reason, rather than the inputs it misses."""
    if TEXT_INPUT in inputs and all(spec.name != TEXT_INPUT for spec in specs):
        raise WireError(
            "bad_request",
            f"inputs.{TEXT_INPUT} (text) needs a tokenizer.json in the version folder, and "
            "this version has none: send the model's own inputs",
            request_id,
        )
