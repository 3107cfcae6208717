"""A model's `[[postprocess]]`: ops on its outputs, in order, before they are sent.

Each op works on one output (``output = NAME``)::

    [[postprocess]]
    output = "logits"
    op = "softmax"             # softmax | sigmoid (axis = -1)
    [[postprocess]]
    output = "logits"
    op = "topk"                # NAME: values, NAME_indices, NAME_labels (with labels)
    k = 5
    labels = "labels.txt"      # one label per line, in the version folder; "config.json":
                               # its id2label (what transformers' save_pretrained writes)
    [[postprocess]]
    output = "output0"
    op = "detect"              # boxes, scores, classes, labels (agent.models.detect)
    format = "yolov8"          # yolov8 (also YOLO11) | yolov5 | boxes_scores (+ scores = NAME)
                               # | end2end (final detections: YOLO26 NMS-free, nms=True,
                               #   RT-DETR with box_format = "xywh" and normalized = true)
                               # | obb (oriented boxes: YOLOv8/11-obb; boxes [n, 5] xywhr)
    keypoints = [17, 3]        # a pose model's kpt_shape: NAME's last K * D values a box
    score_threshold = 0.25
    iou_threshold = 0.45
    max_detections = 300

and ``ctc`` (``labels``, ``space``, ``blank``: a text recogniser's ``[batch, steps, classes]``
as ``NAME_text`` and ``NAME_score``, agent.models.ctc), ``db`` (``thresh``, ``box_thresh``,
``unclip_ratio``, ``max_candidates``: a DB text detector's map as ``boxes`` and ``scores``,
agent.models.text_boxes; needs OpenCV), ``entities`` (``labels``, ``aggregation`` none | simple |
first | average | max: a token classifier's ``[texts, sequence, labels]`` as the ``entities``
of the request's text, agent.models.entities),
``pool`` (``method`` mean | cls, ``normalize``: an encoder's hidden states as one
``sentence_embedding`` a text, agent.models.pooling),
``argmax`` (axis, keepdims; int64 in place),
``threshold`` (value; a uint8 0/1 mask in place: ``x > value``), ``cast`` (dtype), ``drop``.
The ops run in numpy on every request's and every source frame's outputs, after the outputs
a request or source asked for were chosen: an op whose output is not among them is skipped.
An op naming an output that neither the model nor an earlier op makes, or a labels file that
cannot be read, fails the version at load (:func:`build_postprocess` raises
:class:`ModelLoadError`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.models.backends.base import InferenceError, ModelLoadError
from agent.models.ctc import HF_VOCAB, CtcSpec, decode_ctc, hf_ctc_spec
from agent.models.detect import DetectSpec, decode_detections
from agent.models.entities import Aggregation, EntitiesSpec, decode_entities
from agent.models.hf_files import read_json
from agent.models.pooling import POOLED, PoolSpec, pool_texts
from agent.models.preprocess import load_cv2
from agent.models.resize import Geometry
from agent.models.text_boxes import TextBoxSpec, decode_text_boxes
from agent.models.text_file import read_text_limited
from agent.models.text_inputs import TextBatch

__all__ = ["PostprocessOp", "Postprocessor", "build_postprocess"]

Array = npt.NDArray[Any]
Outputs = dict[str, Any]

MAX_LABELS_BYTES = 1 << 20
HF_CONFIG = "config.json"  # `labels` naming it: its id2label
CastDtype = Literal["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8"]
# The keys each op takes besides `output` and `op`.
_OP_KEYS: dict[str, frozenset[str]] = {
    "softmax": frozenset({"axis"}),
    "sigmoid": frozenset(),
    "argmax": frozenset({"axis", "keepdims"}),
    "topk": frozenset({"k", "axis", "labels"}),
    "threshold": frozenset({"value"}),
    "cast": frozenset({"dtype"}),
    "drop": frozenset(),
    "detect": frozenset(
        {"format", "scores", "box_format", "normalized", "score_threshold", "iou_threshold"}
        | {"max_detections", "labels", "keypoints", "masks"}
    ),
    "ctc": frozenset({"labels", "space", "blank"}),
    "db": frozenset({"thresh", "box_thresh", "unclip_ratio", "max_candidates"}),
    "entities": frozenset({"labels", "aggregation"}),
    "pool": frozenset({"method", "normalize"}),
}


class PostprocessOp(BaseModel):
    """One `[[postprocess]]` entry (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    output: str = Field(min_length=1)
    op: Literal[
        "softmax",
        "sigmoid",
        "argmax",
        "topk",
        "threshold",
        "cast",
        "drop",
        "detect",
        "ctc",
        "db",
        "entities",
        "pool",
    ]
    axis: int = -1
    keepdims: bool = False
    k: int = Field(default=1, ge=1, le=65536)
    labels: str | None = None
    value: float = 0.5
    dtype: CastDtype | None = None
    format: Literal["yolov8", "yolov5", "boxes_scores", "end2end", "obb"] = "yolov8"
    scores: str | None = None
    box_format: Literal["xywh", "xyxy"] | None = None
    normalized: bool = False  # detect: boxes in fractions of the input's size (RT-DETR)
    keypoints: list[int] | None = None  # detect: a pose model's [K, D] (its kpt_shape)
    masks: str | None = None  # detect: a segmentation model's prototypes output
    score_threshold: float = Field(default=0.25, ge=0, le=1)
    iou_threshold: float = Field(default=0.45, ge=0, le=1)
    max_detections: int = Field(default=300, ge=1, le=10000)
    space: bool = False  # ctc: a space as the class after the labels (PaddleOCR's use_space_char)
    blank: int = Field(default=0, ge=0)  # ctc: the blank's class
    # db: PaddleOCR's inference defaults (DBPostProcess as its det models are run)
    thresh: float = Field(default=0.3, ge=0, le=1)
    box_thresh: float = Field(default=0.6, ge=0, le=1)
    unclip_ratio: float = Field(default=1.5, gt=0, le=10)
    max_candidates: int = Field(default=1000, ge=1, le=100000)
    method: Literal["mean", "cls"] = "mean"  # pool: the tokens' mean, or the first token's
    normalize: bool = False  # pool: L2-normalised
    aggregation: Aggregation = "simple"  # entities: the pipeline's aggregation_strategy

    @model_validator(mode="after")
    def _keys_of_op(self) -> PostprocessOp:
        foreign = sorted(self.model_fields_set - _OP_KEYS[self.op] - {"output", "op"})
        if foreign:
            raise ValueError(f'op = "{self.op}" takes no {", ".join(foreign)}')
        if self.op == "cast" and self.dtype is None:
            raise ValueError('op = "cast" needs dtype')
        if self.op == "ctc" and self.labels is None:
            raise ValueError('op = "ctc" needs labels (a file of the characters, one a line)')
        if self.op == "entities" and self.labels is None:
            raise ValueError('op = "entities" needs labels ("config.json": its id2label)')
        if self.labels == HF_VOCAB and {"space", "blank"} & self.model_fields_set:
            raise ValueError(
                f'labels = "{HF_VOCAB}" takes the blank and the spaces from the tokenizer\'s '
                "files: drop space and blank"
            )
        problem = self._layout_problem() if self.op == "detect" else None
        if problem is not None:
            raise ValueError(problem)
        name = self.labels
        if name is not None and (not name or "/" in name or "\\" in name):
            raise ValueError("labels must be a file name in the version folder (no folders)")
        return self

    def _layout_problem(self) -> str | None:
        """What does not fit a `detect` op's `format` among its other keys."""
        keys = self.model_fields_set
        if (self.format == "boxes_scores") != (self.scores is not None):
            return 'format = "boxes_scores" and scores = NAME go together'
        if self.keypoints is not None and (
            self.format != "yolov8"
            or len(self.keypoints) != 2
            or min(self.keypoints) < 1
            or self.keypoints[1] > 3
        ):
            return (
                'keypoints = [K, D] (a pose model\'s kpt_shape, D 2 or 3) go with format = "yolov8"'
            )
        if self.masks is not None and (self.format != "yolov8" or self.keypoints is not None):
            return (
                "masks = NAME (a segmentation model's prototypes) go with "
                'format = "yolov8", without keypoints'
            )
        if self.format == "obb" and keys & {"box_format", "normalized"}:
            return (
                'format = "obb" takes no box_format or normalized: its boxes are '
                "cx, cy, w, h and an angle, in input pixels"
            )
        if self.format == "end2end" and "iou_threshold" in keys:
            return (
                'format = "end2end" takes no iou_threshold: its output is the model\'s final '
                "detections, a box, a score and a class a row"
            )
        return None


def read_labels(folder: Path, name: str, *, exact: bool = False) -> tuple[str, ...]:
    """One label per line of `folder/name` (blank lines at the end ignored), stripped of
    surrounding white space unless `exact` (a recogniser's characters: a space is one);
    for `config.json`, its `id2label`."""
    if name == HF_CONFIG:
        return _id2label(folder / name)
    text = read_text_limited(
        folder / name,
        MAX_LABELS_BYTES,
        too_large=lambda _: ModelLoadError(f"postprocess: {name} is over {MAX_LABELS_BYTES} bytes"),
        cannot_read=lambda e: ModelLoadError(
            f"postprocess: cannot read labels {name}: {e.strerror or e}"
        ),
        not_text=lambda _: ModelLoadError(f"postprocess: labels {name} is not UTF-8 text"),
    )
    lines = text.rstrip("\n").split("\n")
    return tuple(line.rstrip("\r") if exact else line.strip() for line in lines)


def _id2label(path: Path) -> tuple[str, ...]:
    """The labels of a Hugging Face `config.json`'s `id2label`, class 0 first."""
    found = read_json(path).get("id2label")
    if not isinstance(found, dict) or not found:
        raise ModelLoadError(f"postprocess: {path.name} has no id2label")
    try:
        by_id = {int(key): value for key, value in found.items()}
    except ValueError:
        message = f"postprocess: {path.name}'s id2label has a key that is not an id"
        raise ModelLoadError(message) from None
    if sorted(by_id) != list(range(len(by_id))) or not all(
        isinstance(label, str) for label in by_id.values()
    ):
        raise ModelLoadError(
            f"postprocess: {path.name}'s id2label must name the classes 0 to {len(by_id) - 1}"
        )
    return tuple(by_id[i] for i in range(len(by_id)))


@dataclass(frozen=True)
class Given:
    """What a request gave that ops read besides the outputs: its image's geometry (boxes
    back in the image's pixels), its texts as tokenized (entities named in them)."""

    geometry: Geometry | None = None
    texts: TextBatch | None = None


Step = Callable[[Outputs, Given], Outputs]


class Postprocessor:
    """A version's ops, checked and bound (labels read): `apply(outputs, geometry, texts)`."""

    def __init__(self, steps: Sequence[tuple[str, Step]]) -> None:
        self._steps = tuple(steps)

    def apply(
        self, outputs: Outputs, geometry: Geometry | None = None, texts: TextBatch | None = None
    ) -> Outputs:
        """The ops in order on `outputs` (a new dict; ops on absent outputs skipped);
        InferenceError ("postprocess: ...") where an op cannot take an output it is given."""
        result = dict(outputs)
        given = Given(geometry, texts)
        try:
            for name, step in self._steps:
                if name in result:
                    result = step(result, given)
        except (ValueError, TypeError, IndexError) as e:
            raise InferenceError(f"postprocess: {e}") from e
        return result


def build_postprocess(
    ops: Sequence[PostprocessOp], output_names: Sequence[str], folder: Path
) -> Postprocessor | None:
    """The version's ops checked against its outputs (ModelLoadError names the first
    problem); None without ops."""
    if not ops:
        return None
    available = set(output_names)
    steps: list[tuple[str, Step]] = []
    for position, op in enumerate(ops, 1):
        where = f"postprocess #{position} ({op.op} of {op.output!r})"
        named = (op.output, op.scores, op.masks)
        missing = [n for n in named if n is not None and n not in available]
        if missing:
            raise ModelLoadError(
                f"{where}: no output {missing[0]!r} (there are {', '.join(sorted(available))})"
            )
        if op.op == "ctc" and op.labels == HF_VOCAB:  # a Hugging Face CTC tokenizer's
            steps.append((op.output, _ctc_step(hf_ctc_spec(op.output, folder))))
        else:
            exact = op.op == "ctc"
            labels = read_labels(folder, op.labels, exact=exact) if op.labels else None
            steps.append((op.output, _step(op, labels)))
        available |= _made(op)
        available -= _removed(op)
    return Postprocessor(steps)


def _ctc_step(spec: CtcSpec) -> Step:
    return lambda outputs, _: decode_ctc(spec, outputs)


def _made(op: PostprocessOp) -> set[str]:
    if op.op == "topk":
        return {op.output, f"{op.output}_indices", f"{op.output}_labels"}
    if op.op == "detect":
        extra = ["keypoints"] if op.keypoints else ["segments"] if op.masks else []
        return {"boxes", "scores", "classes", "labels", *extra}
    if op.op == "db":
        return {"boxes", "scores"}
    if op.op == "ctc":
        return {f"{op.output}_text", f"{op.output}_score"}
    if op.op == "entities":
        return {"entities"}
    if op.op == "pool":
        return {POOLED}
    return set() if op.op == "drop" else {op.output}


def _removed(op: PostprocessOp) -> set[str]:
    if op.op in ("drop", "ctc", "entities", "pool"):
        return {op.output}
    if op.op == "detect":
        inputs = {name for name in (op.output, op.scores, op.masks) if name is not None}
        return inputs - {"boxes", "scores"}
    if op.op == "db":
        return {op.output} - {"boxes", "scores"}
    return set()


def _step(op: PostprocessOp, labels: tuple[str, ...] | None) -> Step:
    name = op.output
    if op.op == "detect":
        spec = DetectSpec(
            output=name,
            format=op.format,
            scores=op.scores,
            box_format=op.box_format or _box_format(op.format),
            normalized=op.normalized,
            keypoints=(op.keypoints[0], op.keypoints[1]) if op.keypoints else None,
            masks=op.masks,
            score_threshold=op.score_threshold,
            iou_threshold=op.iou_threshold,
            max_detections=op.max_detections,
            labels=labels,
        )
        cv2 = _opencv("detect with masks") if op.masks is not None else None
        return lambda outputs, given: decode_detections(spec, outputs, given.geometry, cv2)
    if op.op == "db":
        cv2 = _opencv('op = "db"')
        boxes = TextBoxSpec(name, op.thresh, op.box_thresh, op.unclip_ratio, op.max_candidates)
        return lambda outputs, given: decode_text_boxes(boxes, outputs, given.geometry, cv2)
    if op.op == "ctc":
        assert labels is not None  # checked by PostprocessOp
        characters = (*labels, " ") if op.space else labels
        if op.blank > len(characters):
            raise ModelLoadError(
                f"postprocess ctc: blank {op.blank} is past the {len(characters) + 1} classes "
                "the labels (and space) and the blank make"
            )
        return _ctc_step(CtcSpec(name, characters, op.blank))
    if op.op == "pool":
        pool = PoolSpec(name, op.method, op.normalize)
        return lambda outputs, given: pool_texts(pool, outputs, given.texts)
    if op.op == "entities":
        assert labels is not None  # checked by PostprocessOp
        entities = EntitiesSpec(name, labels, op.aggregation)
        return lambda outputs, given: decode_entities(entities, outputs, given.texts)
    if op.op == "topk":
        # an index past the labels: "" (the table built once, not per request)
        table = np.array([*labels, ""], dtype=object) if labels is not None else None
        return lambda outputs, _: _topk(outputs, name, op.k, op.axis, table)
    if op.op == "drop":
        return lambda outputs, _: {k: v for k, v in outputs.items() if k != name}
    transform = _elementwise(op)
    return lambda outputs, _: {**outputs, name: transform(_numeric(outputs[name], op))}


def _opencv(what: str) -> Any:
    """OpenCV for an op that needs it; ModelLoadError (the version fails) without it."""
    cv2 = load_cv2()
    if cv2 is None:
        raise ModelLoadError(
            f"postprocess: {what} needs OpenCV (pip install opencv-python-headless)"
        )
    return cv2


def _box_format(layout: str) -> str:
    """A `detect` layout's boxes unless `box_format` says: YOLO's centres, else corners."""
    return "xywh" if layout in ("yolov8", "yolov5") else "xyxy"


def _numeric(value: Any, op: PostprocessOp) -> Array:
    array = np.asarray(value)
    if array.dtype.kind not in "uifb":
        raise ValueError(f"postprocess {op.op}: {op.output} is {array.dtype}, not a number tensor")
    return array


def _elementwise(op: PostprocessOp) -> Callable[[Array], Array]:
    if op.op == "softmax":
        return lambda x: _softmax(x, op.axis)
    if op.op == "sigmoid":
        return _sigmoid
    if op.op == "argmax":
        return lambda x: np.argmax(x, axis=op.axis, keepdims=op.keepdims).astype(np.int64)
    if op.op == "threshold":
        return lambda x: (x > op.value).astype(np.uint8)
    dtype = np.dtype(op.dtype)
    return lambda x: x.astype(dtype, copy=False)


def _float(x: Array) -> Array:
    return x if x.dtype.kind == "f" else x.astype(np.float32)


def _softmax(x: Array, axis: int) -> Array:
    x = _float(x)
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    result: Array = shifted / np.sum(shifted, axis=axis, keepdims=True)
    return result


def _sigmoid(x: Array) -> Array:
    x = _float(x)
    result: Array = 0.5 * (np.tanh(x * 0.5) + 1.0)  # no overflow for large |x|
    return result.astype(x.dtype, copy=False)


def _topk(outputs: Outputs, name: str, k: int, axis: int, table: Array | None) -> Outputs:
    x = np.asarray(outputs[name])
    size = x.shape[axis]
    k = min(k, size)
    part = np.argpartition(-x, k - 1, axis=axis) if k < size else np.argsort(-x, axis=axis)
    top = np.take(part, np.arange(k), axis=axis)
    values = np.take_along_axis(x, top, axis=axis)
    order = np.argsort(-values, axis=axis, kind="stable")
    indices = np.take_along_axis(top, order, axis=axis).astype(np.int64)
    result = {**outputs, name: np.take_along_axis(values, order, axis=axis)}
    result[f"{name}_indices"] = indices
    if table is not None:
        result[f"{name}_labels"] = table[np.minimum(indices, len(table) - 1)]
    return result
