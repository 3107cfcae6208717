"""Dynamic batching: requests for one model version that were queued together run as one batch.

Like Triton's dynamic batcher (`[batching]` in a model's config.toml): the scheduler hands a
worker up to `max_batch` leading-axis items of requests for the same model and pinned version
(`agent.inference.scheduler.BatchSpec`); here their inputs are joined along the leading
axis, the model runs once per batch (once per step in `steps` mode) and every request gets
its own rows of every output, which it streams as its own chunks. Requests whose inputs
cannot be joined (another dtype, other trailing dims) run as separate batches.

This module holds the rows' arithmetic (which requests can be joined, joining, splitting)
and the spec a request is queued with; the run itself is the one runner's
(`agent.inference.modes`), where a batch is a run of several members.

Why it pays on a CPU too: each run costs the agent a fixed amount (a lease, the calls into
the runtime, the per-run bookkeeping, a GIL hand-over while the model runs) besides the
arithmetic; a batch pays it once. On a GPU each run is also a kernel launch per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.inference.scheduler import BatchSpec
from agent.models.backends.base import Array, InferenceError
from agent.models.manager import Serving
from agent.protocol.requests import Request

Arrays = dict[str, Array]


def leading_rows(inputs: Mapping[str, Array]) -> int | None:
    """The shared leading-axis size of all inputs, or None (then it cannot be batched)."""
    sizes = {arr.shape[0] if arr.ndim else None for arr in inputs.values()}
    if len(sizes) != 1:
        return None
    (rows,) = sizes
    return rows


def signature(inputs: Mapping[str, Array]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """What must agree for inputs to be joined: names, dtypes and the dims after the first."""
    return tuple(sorted((name, arr.dtype.str, arr.shape[1:]) for name, arr in inputs.items()))


def groups(inputs: Sequence[Mapping[str, Array]]) -> list[list[int]]:
    """Indices of `inputs` (one mapping per request) that can be joined, in order of first
    appearance."""
    by_signature: dict[tuple[Any, ...], list[int]] = {}
    for index, arrays in enumerate(inputs):
        by_signature.setdefault(signature(arrays), []).append(index)
    return list(by_signature.values())


def join(parts: Sequence[Arrays]) -> Arrays:
    """The inputs of several requests as one batch along the leading axis (one copy)."""
    names = parts[0].keys()
    return {name: np.concatenate([p[name] for p in parts], axis=0) for name in names}


def check_rows(outputs: Mapping[str, Array], total: int) -> None:
    """Every output has the batch's rows on its leading axis (else it cannot be split)."""
    for name, arr in outputs.items():
        if arr.ndim == 0 or arr.shape[0] != total:
            raise InferenceError(
                f"output {name!r} has shape {list(arr.shape)}: a batch of {total} needs "
                f"{total} rows (the model has no batch axis there)"
            )


def split(outputs: Mapping[str, Array], rows: Sequence[int]) -> list[Arrays]:
    """Each request's rows of every output (views, no copy)."""
    check_rows(outputs, sum(rows))
    result = []
    start = 0
    for n in rows:
        result.append({name: arr[start : start + n] for name, arr in outputs.items()})
        start += n
    return result


def batch_spec(request: Request, serving: Serving) -> BatchSpec | None:
    """How the request may share a run with others (its model's `[batching]`), or None."""
    config = serving.batching
    if config is None:
        return None
    # a generation is one row of its batch, whatever its prompt (agent.inference.generate)
    rows = 1 if serving.stream.mode == "generate" else leading_rows(request.inputs)
    if rows is None or rows >= config.max_batch:
        return None  # nothing to join (or no room for another request)
    return _shared_batch_spec(
        request.model, request.version, rows, config.max_batch, config.max_queue_delay_us
    )


@functools.lru_cache(maxsize=256)
def _shared_batch_spec(
    model: str, version: int | None, rows: int, max_batch: int, delay_us: int
) -> BatchSpec:
    """One (immutable) spec per kind of request, not one per request: making the frozen
    dataclass cost 1.4 µs, on the network thread, for each request of a batched model."""
    return BatchSpec((model, version), rows, max_batch, delay_us / 1e6)
