"""How runs of a model become pieces: the streaming modes, as strategies of one loop.

A :class:`Run` is a group of one or more requests (members) against one leased session.
Its mode's strategy drives the model and yields, after every run of the model, the pieces
that run produced, one per member still running (a list: the runner publishes them
together). Each :class:`Piece` says whose it is, its chunk `index` and whether it is that
member's `last`. The modes:

* `whole`: one run, one piece per member.
* `batch`: the member's leading axis `micro_batch` items at a time, one piece per slice
  (`index` = the first item of the slice).
* `steps`: the model is one decode step; outputs are fed back as inputs (`feed`, `state`)
  and each step's `emit` outputs are a piece. Members decode in lock step and leave the run
  when their stop condition holds for their rows or they reached their own `max_steps`.
* `generate`: a decoder, prefill then a token a run (`agent.inference.generate`, which
  registers itself here).
* `scan`: the member's `[scan] input` is cut into windows (`agent.inference.windows`), the
  model runs once per window with the other inputs whole and the `state` outputs fed to the
  next window; a piece per `windows_per_chunk` windows (`index` = its first window's
  number, `offset` = that window's first new sample). Members run one after the other.

A group of one request is run on its inputs as given (no join, no split: its model need not
have a batch axis); a group of several is joined along the leading axis (`batching`) and
every member gets its own rows of every output. Cancellation is checked before every run:
a cancelled member leaves the run and is noted in `failed`; so does a member its driver put
in `failed` itself (its reply passed its budget).

A new mode is one more strategy function in `STRATEGIES`: it gets the run, calls
`run.model(inputs)` and yields lists of pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from agent.inference import batching
from agent.inference.fed_runs import FedRuns
from agent.inference.job import CancelFlag, Cancelled
from agent.inference.scan import ScanCursor
from agent.models.backends.base import (
    Array,
    DeviceBinding,
    InferenceError,
    Session,
    StepBinding,
)
from agent.models.model_config import ScanConfig, StreamConfig
from agent.protocol.errors import WireError, show_value

Arrays = dict[str, Array]


@dataclass
class Member:
    """One request of a run: its checked inputs, its step limit, its cancel flag."""

    inputs: Arrays
    max_steps: int = 1
    cancelled: CancelFlag = field(default_factory=CancelFlag)
    select: Sequence[str] | None = None  # `params.outputs`; None: the model's `emit`
    cursor: ScanCursor | None = None  # scan: where its recording stands (a session's)
    session: str | None = None  # scan: its `params.session`
    final: bool = True  # scan: the recording's last piece (its tail is flushed)
    generation: Any = None  # generate: its `agent.inference.generate.GenerateAsk`
    # padded to join a run (`agent.inference.texts.pad_to_join`): its own sequence length,
    # and the outputs whose token axis (1) is cut back to it
    trim: tuple[int, frozenset[str]] | None = None

    @property
    def rows(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])


@dataclass
class Piece:
    """One member's outputs of one run: a chunk (or a slice of its result)."""

    member: int  # the member's position in the run
    index: int  # the chunk's `index`: step number, first item of a slice, 0
    outputs: Arrays
    last: bool  # the member's final piece
    offset: int | None = None  # scan: the chunk's `offset` (its first window's first sample)
    extra: dict[str, Any] | None = None  # more keys of its chunk (generate: `text`)
    chunk: bool = True  # False: no chunk, only the end (a cancelled generate, nothing new)
    # scan, several windows a chunk: each window's outputs, before they were stacked (the
    # `[[postprocess]]` ops run on each window, then the results are stacked: `stacked`)
    windows: list[Arrays] | None = None


class Run:
    """One group of members against one session: see the module docstring."""

    def __init__(
        self,
        session: Session,
        config: StreamConfig,
        members: Sequence[Member],
        scan: ScanConfig | None = None,
        window_rows: Callable[[Array], Array] | None = None,
    ) -> None:
        self.session = session
        self.config = config
        self.scan = scan
        # scan: what each window's rows go through before the model (a speech encoder's
        # normalisation: `agent.models.audio_inputs`); None: nothing
        self.window_rows = window_rows
        self.members = members
        self.joined = len(members) > 1
        self.infer_s = 0.0
        self.runs = 0
        self.failed: dict[int, Exception] = {}  # member position -> why it left the run
        self._emitted: list[str] | None = None

    def emitted(self, outputs: Arrays) -> list[str]:
        """The model's `emit` outputs (worked out once a run, from the first outputs)."""
        if self._emitted is None:
            self._emitted = self.config.emitted(list(outputs))
        return self._emitted

    def model(self, inputs: Mapping[str, Array], keep: Collection[str] = ()) -> Arrays:
        """One run of the model, timed. `keep`: outputs left on the session's device (a
        `DeviceBinding` session's runtime values, fed back as they are)."""
        started = time.perf_counter()
        if keep:  # only asked of a DeviceBinding session (`Generation.device_cache`); a cast,
            # not isinstance: a runtime protocol check costs ~19 µs, every step
            outputs = cast(DeviceBinding, self.session).run_keeping(inputs, keep)
        else:
            outputs = self.session.run(inputs)
        return self._counted(started, outputs)

    def other(self, session: Session, inputs: Mapping[str, Array]) -> Arrays:
        """One run of another of the version's sessions (an encoder-decoder's encoder), timed
        with the model's."""
        started = time.perf_counter()
        return self._counted(started, session.run(inputs))

    def bound(self, binding: StepBinding, copied: Collection[str]) -> Arrays:
        """One run of a steps loop's bound model (`agent.inference.fed_runs`), timed;
        `copied`: the outputs that may outlive the run after next."""
        started = time.perf_counter()
        return self._counted(started, binding.run(copied))

    def _counted(self, started: float, outputs: Arrays) -> Arrays:
        """A run that began at `started` (perf_counter) ended with `outputs`: counted."""
        self.infer_s += time.perf_counter() - started
        self.runs += 1
        return outputs

    def live(self, positions: Sequence[int]) -> list[int]:
        """`positions` less the members that left: cancelled meanwhile (then noted in
        `failed`), or put in `failed` by the driver."""
        kept = []
        failed = self.failed
        for position in positions:
            if position in failed:
                continue
            flag = self.members[position].cancelled
            if flag.is_set():
                self.failed[position] = Cancelled(by_request=flag.by_request)
            else:
                kept.append(position)
        return kept

    def pieces(self) -> Iterator[list[Piece]]:
        """After each run of the model, the pieces it produced."""
        return STRATEGIES[self.config.mode](self)


def whole(run: Run) -> Iterator[list[Piece]]:
    active = run.live(range(len(run.members)))
    if not active:
        return
    members = [run.members[p] for p in active]
    if run.joined:
        outputs = run.model(batching.join([m.inputs for m in members]))
        parts = batching.split(outputs, [m.rows for m in members])
        parts = [_cut_back(m, part) for m, part in zip(members, parts, strict=True)]
    else:
        parts = [run.model(members[0].inputs)]
    yield [Piece(p, 0, _chosen(run, p, part), True) for p, part in zip(active, parts, strict=True)]


def _cut_back(member: Member, outputs: Arrays) -> Arrays:
    """A member padded to join the run: its token outputs cut back to its own length."""
    if member.trim is None:
        return outputs
    width, names = member.trim
    return {name: v[:, :width] if name in names else v for name, v in outputs.items()}


def slices(run: Run) -> Iterator[list[Piece]]:
    step = run.config.micro_batch
    for position, member in enumerate(run.members):
        total = _shared_leading_axis(member.inputs)
        for start in range(0, total, step):
            if not run.live([position]):
                break
            part = {k: v[start : start + step] for k, v in member.inputs.items()}
            outputs = _chosen(run, position, run.model(part))
            yield [Piece(position, start, outputs, start + step >= total)]


def steps(run: Run) -> Iterator[list[Piece]]:
    config = run.config
    members = run.members
    links = (*config.feed.items(), *config.state.items())
    active = list(range(len(members)))
    rows = [members[p].rows for p in active] if run.joined else [0]
    inputs = batching.join([m.inputs for m in members]) if run.joined else dict(members[0].inputs)
    fed_runs = FedRuns(run, dict(links))
    try:
        yield from _stepped(run, fed_runs, links, active, rows, inputs)
    finally:
        fed_runs.close()


def _stepped(
    run: Run,
    fed_runs: FedRuns,
    links: Sequence[tuple[str, str]],
    active: list[int],
    rows: list[int],
    inputs: Arrays,
) -> Iterator[list[Piece]]:
    step = 0
    while True:
        live = run.live(active)
        if not live:
            return
        if len(live) < len(active):
            (inputs,), rows = _keep_rows(rows, [active.index(p) for p in live], inputs)
            active = live
        outputs = fed_runs.model(inputs)
        if run.joined:
            batching.check_rows(outputs, sum(rows))
        pieces = _step_pieces(run, outputs, active, rows, step)
        yield pieces
        going_on = [k for k, piece in enumerate(pieces) if not piece.last]
        if not going_on:
            return
        if len(going_on) < len(active):
            (inputs, outputs), rows = _keep_rows(rows, going_on, inputs, outputs)
            active = [active[k] for k in going_on]
        inputs = _fed(inputs, outputs, links)
        step += 1


def scan(run: Run) -> Iterator[list[Piece]]:
    assert run.scan is not None  # the config's validator: mode = "scan" has [scan]
    for position in range(len(run.members)):
        yield from _scan_member(run, run.scan, position)


def _scan_member(run: Run, config: ScanConfig, position: int) -> Iterator[list[Piece]]:
    """One member's windows through the model, state carried, cancellation checked before
    every window; the cursor keeps the state (for a session's next request)."""
    member = run.members[position]
    cursor = member.cursor or ScanCursor.fresh(config)
    windows = cursor.windows(config, member.inputs[config.input], final=member.final)
    inputs = {**member.inputs, **(cursor.state or {})}
    links = list(run.config.state.items())
    per_chunk = config.windows_per_chunk
    for start in range(0, len(windows), per_chunk):
        group = windows[start : start + per_chunk]
        outputs: list[Arrays] = []
        for _, window in group:
            if not run.live([position]):
                return
            inputs[config.input] = window if run.window_rows is None else run.window_rows(window)
            result = run.model(inputs)
            inputs = _fed(inputs, result, links)
            cursor.state = {name: inputs[name] for name in run.config.state}
            outputs.append(_chosen(run, position, result))
        first = group[0][0]
        piece = outputs[0] if per_chunk == 1 else stacked(outputs)
        last = start + per_chunk >= len(windows)
        parts = outputs if per_chunk > 1 else None
        yield [Piece(position, first // config.hop, piece, last, offset=first, windows=parts)]


def stacked(outputs: list[Arrays]) -> Arrays:
    """Several windows' outputs as one piece: on a new leading axis (lists: a list)."""
    return {name: _joined("steps", [o[name] for o in outputs]) for name in outputs[0]}


def _chosen(run: Run, position: int, outputs: Arrays) -> Arrays:
    """The outputs a member's chunks carry: its `params.outputs`, else the model's `emit`
    (default: all but the state outputs). The others are never encoded."""
    names = run.members[position].select or run.emitted(outputs)
    try:
        return {name: outputs[name] for name in names}
    except KeyError as missing:  # asked for by name; not fetched (its type has no numpy form)
        spec = next((s for s in run.session.outputs if s.name == missing.args[0]), None)
        kind = spec.onnx_type if spec is not None else "unknown"
        raise InferenceError(
            f"output {missing.args[0]!r} is {kind}, which the runtime cannot hand over "
            "(no numpy type): ask for the model's other outputs (params.outputs)"
        ) from None


def _step_pieces(
    run: Run, outputs: Arrays, active: list[int], rows: list[int], step: int
) -> list[Piece]:
    """Each active member's rows of one step's outputs; `last` where it stops."""
    stop = run.config.stop
    pieces = []
    start = 0
    for position, count in zip(active, rows, strict=True):
        end = start + count
        mine = _rows_of(outputs, start, end) if run.joined else outputs
        stopped = stop is not None and bool(np.all(mine[stop.output] == stop.value))
        last = stopped or step + 1 >= run.members[position].max_steps
        pieces.append(Piece(position, step, _chosen(run, position, mine), last))
        start = end
    return pieces


def _rows_of(arrays: Mapping[str, Array], start: int, end: int) -> Arrays:
    return {name: arr[start:end] for name, arr in arrays.items()}


def _keep_rows(
    rows: list[int], keep: list[int], *arrays: Arrays
) -> tuple[tuple[Arrays, ...], list[int]]:
    """Each of `arrays` (of a joined run) cut to the rows of the members at positions `keep`,
    and those members' row counts."""
    if len(rows) == 1:  # one member: nothing to cut
        return arrays, rows
    starts = np.cumsum([0, *rows])
    take = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in keep])
    cut = tuple({name: arr[take] for name, arr in a.items()} for a in arrays)
    return cut, [rows[k] for k in keep]


def _fed(inputs: Arrays, outputs: Arrays, links: Sequence[tuple[str, str]]) -> Arrays:
    """The next step's inputs: each `feed`/`state` output in place of its input."""
    next_inputs = dict(inputs)
    for target, source in links:
        value, expected = outputs[source], inputs[target]
        if value.dtype != expected.dtype or value.shape != expected.shape:
            raise InferenceError(
                f"cannot feed output '{source}' {value.dtype}{list(value.shape)} "
                f"into input '{target}' {expected.dtype}{list(expected.shape)}"
            )
        next_inputs[target] = value
    return next_inputs


def _shared_leading_axis(inputs: Mapping[str, Array]) -> int:
    rows = batching.leading_rows(inputs)
    if rows is None:
        raise WireError(
            "bad_request", "batch mode needs every input to share the same leading axis"
        )
    return int(rows)


Strategy = Callable[[Run], Iterator[list[Piece]]]
STRATEGIES: dict[str, Strategy] = {
    "whole": whole,
    "batch": slices,
    "steps": steps,
    "scan": scan,
}


def max_steps(config: StreamConfig, params: Mapping[str, Any]) -> int:
    """Steps a request may run: `params.max_steps` (checked), else the model's bound."""
    limit = config.max_steps
    if params.get("max_steps") is None:
        return limit
    return integer_param(params, "max_steps", limit, low=1, high=limit)


def one_text(value: Any, name: str) -> object:
    """The item of a request's `inputs.NAME` that must hold one text (`bad_request` where it
    is not a one-element string tensor); the caller checks what the item is."""
    if not (isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "OU"):
        raise WireError("bad_request", f"inputs.{name} must be one text")
    return value.reshape(()).item()


def integer_param(
    params: Mapping[str, Any], key: str, default: int, *, low: int = 0, high: int
) -> int:
    """`params[key]` (`default` where absent), checked: an integer from `low` to `high`, else
    `bad_request` (a bool is no integer here)."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise WireError("bad_request", f"params.{key} must be an integer from {low} to {high}")
    return value


def selected_outputs(
    config: StreamConfig, output_names: Sequence[str], params: Mapping[str, Any]
) -> list[str] | None:
    """`params.outputs` checked against what the model emits (None: not asked)."""
    asked = params.get("outputs")
    if asked is None:
        return None
    emitted = config.emitted(output_names)
    if (
        not isinstance(asked, list)
        or not asked
        or not all(isinstance(name, str) for name in asked)
        or len(set(asked)) != len(asked)
    ):
        raise WireError(
            "bad_request", "params.outputs must be a non-empty array of distinct output names"
        )
    unknown = [name for name in asked if name not in emitted]
    if unknown:
        raise WireError(
            "bad_request",
            f"params.outputs names {', '.join(show_value(n, 40) for n in unknown[:5])}, "
            f"not an output this model sends (it sends {', '.join(emitted)})",
        )
    return list(asked)


def initial_state(
    session: Session, config: StreamConfig, inputs: Arrays, scan: ScanConfig | None = None
) -> Arrays:
    """Zero-filled state inputs the request did not give (symbolic dims: the batch size:
    the leading axis of the first input that has one; for a scan, of its `[scan] input`
    where the windows do not run along that axis)."""
    if config.mode not in ("steps", "scan"):
        return inputs
    batch = _batch_of(inputs, scan)
    full = dict(inputs)
    for spec in session.inputs:
        if spec.name in config.state and spec.name not in full:
            shape = tuple(d if isinstance(d, int) else batch for d in spec.shape)
            full[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return full


def _batch_of(inputs: Arrays, scan: ScanConfig | None) -> int:
    signal = inputs.get(scan.input) if scan is not None else None
    if signal is not None:
        along = scan.axis % signal.ndim if scan is not None and signal.ndim else 0
        return int(signal.shape[0]) if signal.ndim > 1 and along != 0 else 1
    given = [v for v in inputs.values() if v.ndim]
    return int(given[0].shape[0]) if given else 1


def merge_pieces(mode: str, pieces: list[tuple[int, Arrays]], *, per_chunk: int = 1) -> Arrays:
    """The whole output for `stream: false`.

    `batch` slices are concatenated back along the leading axis; `steps` and `scan` outputs
    are stacked on a new leading axis (one entry per step or window; a scan's pieces of
    `per_chunk` > 1 windows, stacked already, are concatenated), so `result` carries exactly
    what the chunks would have carried.
    """
    if not pieces:
        return {}
    if mode == "whole":
        return pieces[0][1]
    if mode == "scan" and per_chunk > 1:
        mode = "batch"  # the same joining: along the windows' axis
    names = list(pieces[0][1])
    return {n: _joined(mode, [p[1][n] for p in pieces]) for n in names}


def _joined(mode: str, values: list[Any]) -> Any:
    """One output's pieces as one value: tensors joined as above; a `seq` output (a list,
    such as a classifier's ZipMap) as one list, of items (`batch`) or of steps (`steps`)."""
    if all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate(values, axis=0) if mode == "batch" else np.stack(values, axis=0)
    if mode == "batch":
        return [item for value in values for item in value]
    return list(values)
