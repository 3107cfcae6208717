"""The pcm source (`kind = "pcm"`): live audio or any sampled signal through a windowed model
with carried state (a model with `[stream] mode = "scan"`, e.g. silero-vad).

The reader (agent.sources.readers.pcm) cuts the samples into the model's `[scan]` windows on
the source thread; this module checks at each opening that the model can take them
(`window_plan`) and runs them on the worker (`CarriedState`), one model run a window.

Why it is built on the ordinary source runner: a source already has one frame in the model at
a time, in order (one ticket per source, decision 0016), which is exactly what a state carried
from window to window needs; `policy = "all"` (forced for pcm) loses none. So the state lives
here, is touched only by whichever worker runs the source's record (handed over under the
runner's lock), and starts from zeros at each opening (`fresh` records) and when a new model
version serves.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.config import SourceConfig
from agent.inference.modes import stacked
from agent.inference.send_hold import SendHold
from agent.models.backends.base import Array, InferenceError, TensorSpec
from agent.models.defaults import default_arrays
from agent.models.manager import LoadedVersion
from agent.protocol.errors import WireError
from agent.protocol.requests import validate_inputs
from agent.sources.base import Reader, SourceError
from agent.sources.frames import Frame
from agent.sources.readers.pcm import PcmReader, PcmRecord, WindowPlan
from agent.sources.runner import SourceRunner
from agent.sources.transcribe import Transcriber, extractor_rate_problem, speech_window_plan

# `[defaults]` inputs that hold a sample rate: the source's `sample_rate` must match them.
SAMPLE_RATE_NAMES = frozenset({"sr", "sample_rate", "sampling_rate", "samplerate", "rate"})


def window_plan(config: SourceConfig, loaded: LoadedVersion) -> WindowPlan:
    """How the source feeds `loaded`; SourceError naming what does not fit (checked at every
    opening, so a hot-swapped model with another `[scan]` is picked up at the next one)."""
    model = loaded.config
    if model.stream.mode == "generate":
        return speech_window_plan(config, loaded)
    speech_keys = [k for k in ("window", "hop", "params", "previous_text") if getattr(config, k)]
    if speech_keys:
        raise SourceError(
            f"{', '.join(speech_keys)}: for a speech recogniser; a scan model's windows are "
            "its [scan]"
        )
    scan = model.scan
    if model.stream.mode != "scan" or scan is None:
        raise SourceError(
            f"model '{config.model}' is not a scan model: a pcm source needs [stream] "
            'mode = "scan" and a [scan] section in its config.toml, or a speech recogniser '
            '(mode = "generate")'
        )
    specs = {spec.name: spec for spec in loaded.session.inputs}
    spec = specs.get(scan.input)
    if spec is None:
        raise SourceError(f"model '{config.model}' has no input '{scan.input}' ([scan] input)")
    assert config.channels is not None
    _check_layout(config, spec, scan.axis)
    rate = loaded.audio.sample_rate if loaded.audio is not None else None
    problem = sample_rate_problem(config, model.defaults) or extractor_rate_problem(config, rate)
    if problem is not None:
        raise SourceError(problem)
    unfed = sorted(set(specs) - {scan.input} - set(model.stream.state) - set(model.defaults))
    if unfed:
        raise SourceError(
            f"model '{config.model}' input(s) {', '.join(unfed)} get no value from a pcm "
            "source: give them in the model's [defaults]"
        )
    return WindowPlan(
        input=scan.input,
        window=scan.window,
        hop=scan.hop,
        lead=scan.lead,
        tail=scan.tail,
        per_chunk=config.windows_per_chunk or scan.windows_per_chunk,
        mono_rank1=len(spec.shape) == 1,
    )


def _check_layout(config: SourceConfig, spec: TensorSpec, axis: int) -> None:
    """The source feeds [channels, samples] (channels as the batch), or [samples] for mono."""
    rank = len(spec.shape)
    last = axis in (-1, rank - 1)
    channels = config.channels or 1
    if rank not in (1, 2) or not last or (rank == 1 and channels != 1):
        raise SourceError(
            f"model '{config.model}' input '{spec.name}' is {list(spec.shape)}: a pcm source "
            "feeds [channels, samples] windows (channels as the batch) or [samples] for mono, "
            "windowed along the last axis"
        )
    batch = spec.shape[0]
    if rank == 2 and isinstance(batch, int) and batch != channels:
        raise SourceError(
            f"model '{config.model}' input '{spec.name}' takes a batch of {batch}, the source "
            f"has channels = {channels}"
        )


def sample_rate_problem(config: SourceConfig, defaults: Mapping[str, Any]) -> str | None:
    """Where the model's `[defaults]` give a sample rate (an input named like `sr`), the
    source's `sample_rate` must be it: a model fed at the wrong rate answers nonsense."""
    for name, value in defaults.items():
        if name.lower() not in SAMPLE_RATE_NAMES or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and value != config.sample_rate:
            return (
                f"sample_rate = {config.sample_rate} does not match model '{config.model}' "
                f"([defaults] {name} = {value}): record at {value:g} Hz or resample in the "
                "command"
            )
    return None


def zero_state(
    session_inputs: Sequence[TensorSpec], names: Sequence[str], batch: int
) -> dict[str, Array]:
    """The state inputs zero-filled, symbolic dims set to the batch (as for `steps`)."""
    return {
        spec.name: np.zeros(
            tuple(d if isinstance(d, int) else batch for d in spec.shape), dtype=spec.dtype
        )
        for spec in session_inputs
        if spec.name in names
    }


class CarriedState:
    """The state a pcm source carries from window to window, with the constant inputs.

    Used by one worker at a time (the source's ticket), so it needs no lock of its own.
    """

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        self.version: int | None = None
        self.fixed: dict[str, Array] = {}
        self.state: dict[str, Array] = {}
        self.links: list[tuple[str, str]] = []
        self.emitted: list[str] = []

    def restart(self, loaded: LoadedVersion, plan: WindowPlan, first: Array) -> None:
        """Zeros for the state; the version's defaults; its feed checked once (every window
        of an opening has the first one's shape and dtype)."""
        session = loaded.session
        self.version = None
        self.links = list(loaded.config.stream.state.items())
        batch = 1 if plan.mono_rank1 else int(first.shape[0])
        self.fixed = default_arrays(loaded.config.defaults, session.inputs)
        self.state = zero_state(session.inputs, [i for i, _ in self.links], batch)
        names = [spec.name for spec in session.outputs]
        self.emitted = self.config.outputs or loaded.config.stream.emitted(names)
        missing = [n for n in (*self.emitted, *(o for _, o in self.links)) if n not in names]
        if missing:
            raise InferenceError(f"the model has no output(s) {', '.join(missing)}")
        validate_inputs(self.config.name, self._feed(plan, first), session.inputs)
        self.version = loaded.version

    def _feed(self, plan: WindowPlan, window: Array) -> dict[str, Array]:
        return {**self.fixed, plan.input: window, **self.state}

    def run(self, loaded: LoadedVersion, record: PcmRecord, chunk: int = 0) -> dict[str, Array]:
        """The windows of the record's `chunk` through the model in order, the state fed back
        after each; the emitted outputs of one window after the version's `[[postprocess]]`,
        or of several stacked on a new leading axis."""
        plan = record.plan
        assert plan is not None
        windows = record.windows(chunk)
        if (record.fresh and chunk == 0) or loaded.version != self.version:
            self.restart(loaded, plan, windows[0])
        run = loaded.session.run
        audio = loaded.audio  # a speech encoder's windows normalised (agent.models.audio_inputs)
        rows = audio.rows if audio is not None and audio.per_window else None
        post = loaded.postprocess  # each window's outputs, as a scan request's chunk has them
        results: list[dict[str, Array]] = []
        for window in windows:
            outputs = run(self._feed(plan, window if rows is None else rows(window)))
            self.state = {name: outputs[out] for name, out in self.links}
            emitted = {name: outputs[name] for name in self.emitted}
            results.append(emitted if post is None else post.apply(emitted))
        if plan.per_chunk == 1:
            return results[0]
        return stacked(results)


class PcmSourceRunner(SourceRunner):
    """A source runner whose records are windows with a state carried through them."""

    def __init__(self, config: SourceConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._carried = CarriedState(config)
        self._transcriber = Transcriber(config)

    def _open_reader(self, specs: Sequence[TensorSpec]) -> Reader:
        try:
            lease = self._models.lease(self.config.model)
        except WireError as e:
            raise SourceError(e.message) from None
        with lease:
            plan = window_plan(self.config, lease.loaded)
        return PcmReader(self, plan)

    def _process(self, frame: Frame, hold: SendHold) -> None:
        """On the worker: the record's chunks in order, with the carried state, each queued on
        the stream as soon as it ran; where something else waits for a worker, the chunks
        left go back to wait for the source's next turn, as frames of their own would. A
        window that fails costs its chunk one error; the state goes on from the last good
        one."""
        record = frame.record
        if not isinstance(record, PcmRecord):
            super()._process(frame, hold)
            return
        try:
            lease = self._models.lease(self.config.model)
        except WireError as e:
            self._errors.frame_failed(frame, e.message, retry=True)
            return
        with lease:
            for chunk in range(record.count):
                if chunk and self._others_wait():
                    self._put_back(frame, chunk)
                    return
                result = self._run_chunk(frame, record, lease.loaded, chunk)
                if result is not None:
                    outputs, version, seconds, more = result
                    self._publish(frame, outputs, version, seconds, hold, chunk=chunk, more=more)

    def _run_chunk(
        self, frame: Frame, record: PcmRecord, loaded: LoadedVersion, chunk: int
    ) -> tuple[dict[str, Array], int, float, dict[str, Any] | None] | None:
        """The chunk's outputs, version, seconds and (a transcription's) more keys of its
        message; None where it failed (counted)."""
        started = time.perf_counter()
        more = None
        try:
            if loaded.generation is not None:
                outputs, more = self._transcriber.run(loaded, record, chunk)
            else:
                outputs = self._carried.run(loaded, record, chunk)
        except WireError as e:
            self._errors.frame_failed(frame, e.message, bad_input=True)
            return None
        except Exception as e:
            self._errors.model_failed(frame, e, frame.index + chunk)
            return None
        return outputs, loaded.version, time.perf_counter() - started, more
