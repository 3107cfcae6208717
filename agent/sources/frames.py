"""A frame of a source and its way into the model: the record as numbered and stamped on the
source thread, its fields mapped to the model's inputs, the outputs the source streams."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from agent.config import SourceConfig
from agent.models.backends.base import Array, InferenceError
from agent.models.manager import LoadedVersion
from agent.models.preprocess import PreprocessError, image_input, preprocess_image
from agent.sources.base import FIELD, Outcome, Record

log = logging.getLogger(__name__)


@dataclass
class Frame:
    """A record as the source thread numbered and stamped it; `finish` tells its reader what
    became of it (a folder then moves the file to done/ or failed/, or leaves it)."""

    index: int
    record: Record
    captured_ns: int  # wall clock, sent as `frame_ts`
    captured: float  # monotonic, for the latency

    def finish(self, outcome: Outcome) -> None:
        if self.record.on_done is not None:
            try:
                self.record.on_done(outcome)
            except Exception:
                log.exception("source: finishing frame %d failed", self.index)


def select_outputs(
    config: SourceConfig, outputs: dict[str, Array], loaded: LoadedVersion
) -> dict[str, Array]:
    """`outputs` of the source, else the model's `[stream] emit`, else every output."""
    names = config.outputs or loaded.config.stream.emit
    if not names:
        return outputs
    missing = [n for n in names if n not in outputs]
    if missing:
        raise InferenceError(f"the model has no output(s) {', '.join(missing)}")
    return {n: outputs[n] for n in names}


def model_inputs(config: SourceConfig, record: Record, loaded: LoadedVersion) -> dict[str, Array]:
    """The record's fields as the model's inputs: mapped by name, then preprocessed (the
    frame's `geometry` then kept on the record and put in its `extra`, sent with its chunk)."""
    pre = loaded.preprocess if config.preprocess else None
    names = [spec.name for spec in loaded.session.inputs]
    target = image_input(pre, loaded.session.inputs)  # None without a [preprocess]
    fields = record.fields
    if config.inputs:
        missing = sorted(f for f in config.inputs.values() if f not in fields)
        if missing:
            raise PreprocessError(
                f"no field(s) {', '.join(missing)} in the record (it has {', '.join(fields)})"
            )
        mapped = {name: fields[f] for name, f in config.inputs.items()}
    elif set(fields) == {FIELD}:
        feeds = target or (names[0] if len(names) == 1 else None)
        if feeds is None:
            raise PreprocessError(
                f"the model has inputs {', '.join(names)}: map the frame to one with "
                'inputs = { NAME = "frame" }'
            )
        mapped = {feeds: fields[FIELD]}
    else:
        mapped = dict(fields)
    if pre is not None and target is not None and target in mapped:
        mapped[target], geometry = preprocess_image(mapped[target], pre, bgr=record.bgr)
        record.geometry = geometry
        record.extra = {**(record.extra or {}), "geometry": geometry.as_wire()}
    return mapped


def postprocessed(
    outputs: dict[str, Array], record: Record, loaded: LoadedVersion
) -> dict[str, Array]:
    """The version's `[[postprocess]]` on a frame's outputs (boxes mapped back through the
    frame's geometry, where it was preprocessed)."""
    post = loaded.postprocess
    return outputs if post is None else post.apply(outputs, record.geometry)
