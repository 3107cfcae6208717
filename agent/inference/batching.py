"""Dynamic batching: requests for one model version that were queued together run as one batch.

Like Triton's dynamic batcher (`[batching]` in a model's config.toml): the scheduler hands a
worker up to `max_batch` leading-axis items of requests for the same model and pinned version
(`agent.inference.scheduler.BatchSpec`); here their inputs are joined along the leading
axis, the model runs once per batch (once per step in `steps` mode) and every request gets
its own rows of every output, which it streams as its own chunks. Requests whose inputs
cannot be joined (another dtype, other trailing dims) run as separate batches.

In `steps` mode the batch decodes in lock step: a request leaves the batch when its stop
condition holds for its rows or it reached its own `max_steps`, and the next step runs on the
rows that are left (a copy of the inputs without the finished rows).

Why it pays on a CPU too: each run costs the agent a fixed amount (a lease, the calls into
the runtime, the per-run bookkeeping, a GIL hand-over while the model runs) besides the
arithmetic; a batch pays it once. On a GPU each run is also a kernel launch per layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.inference.streaming import CancelFlag, Cancelled
from agent.models.backends.base import Array, InferenceError, Session
from agent.models.repository import StreamConfig

Arrays = dict[str, Array]


@dataclass
class Member:
    """One request of a batch: its checked inputs, its step limit, its cancel flag."""

    inputs: Arrays
    max_steps: int = 1
    cancelled: CancelFlag = field(default_factory=CancelFlag)

    @property
    def rows(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])


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


def groups(members: Sequence[Member]) -> list[list[int]]:
    """Indices of `members` whose inputs can be joined, in order of first appearance."""
    by_signature: dict[tuple[Any, ...], list[int]] = {}
    for index, member in enumerate(members):
        by_signature.setdefault(signature(member.inputs), []).append(index)
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


@dataclass
class BatchRun:
    """One batch of members against one session: yields each member's pieces.

    Each item is `(member index, piece index, outputs, last)`; `last` is True on the final
    piece of that member. A cancelled member is dropped between steps with `Cancelled` noted
    in `failed`; a model failure raises (every member still running fails with it).
    """

    session: Session
    stream_config: StreamConfig
    members: Sequence[Member]
    infer_s: float = 0.0
    runs: int = 0
    failed: dict[int, Exception] = field(default_factory=dict)
    # Called after each run's pieces were handed out (the caller publishes them together).
    after_run: Callable[[], None] = lambda: None

    def _run(self, inputs: Mapping[str, Array]) -> Arrays:
        started = time.perf_counter()
        outputs = self.session.run(inputs)
        self.infer_s += time.perf_counter() - started
        self.runs += 1
        return outputs

    def pieces(self) -> Iterator[tuple[int, int, Arrays, bool]]:
        if self.stream_config.mode == "steps":
            yield from self._steps()
        else:
            yield from self._whole()

    def _whole(self) -> Iterator[tuple[int, int, Arrays, bool]]:
        members = self.members
        outputs = self._run(join([m.inputs for m in members]))
        for index, part in enumerate(split(outputs, [m.rows for m in members])):
            yield index, 0, part, True
        self.after_run()

    def _steps(self) -> Iterator[tuple[int, int, Arrays, bool]]:
        config = self.stream_config
        emit = config.emitted([spec.name for spec in self.session.outputs])
        links = (*config.feed.items(), *config.state.items())
        active = list(range(len(self.members)))
        rows = [self.members[i].rows for i in active]
        inputs = join([self.members[i].inputs for i in active])
        step = 0
        while active:
            outputs = self._run(inputs)
            check_rows(outputs, sum(rows))
            keep: list[int] = []  # positions in `active` that go on
            start = 0
            for position, index in enumerate(active):
                member, stop = self.members[index], start + rows[position]
                if member.cancelled.is_set():
                    self.failed[index] = Cancelled()
                    start = stop
                    continue
                stopped = config.stop is not None and bool(
                    np.all(outputs[config.stop.output][start:stop] == config.stop.value)
                )
                last = stopped or step + 1 >= member.max_steps
                yield index, step, {name: outputs[name][start:stop] for name in emit}, last
                if not last:
                    keep.append(position)
                start = stop
            self.after_run()
            if not keep:
                return
            if len(keep) < len(active):
                starts = np.cumsum([0, *rows])
                take = np.concatenate([np.arange(starts[p], starts[p + 1]) for p in keep])
                outputs = {name: arr[take] for name, arr in outputs.items()}
                inputs = {name: arr[take] for name, arr in inputs.items()}
                active = [active[p] for p in keep]
                rows = [rows[p] for p in keep]
            next_inputs = dict(inputs)
            for target, source in links:
                value, expected = outputs[source], inputs[target]
                if value.dtype != expected.dtype or value.shape != expected.shape:
                    raise InferenceError(
                        f"cannot feed output '{source}' {value.dtype}{list(value.shape)} "
                        f"into input '{target}' {expected.dtype}{list(expected.shape)}"
                    )
                next_inputs[target] = value
            inputs = next_inputs
            step += 1
