"""Image inputs of a request and what its outputs go through before they are sent.

For a model with `[preprocess]`, the input it names may come as a JPEG or PNG (a CBOR byte
string, read as an :class:`~agent.protocol.images.EncodedImage` whose header was bounded at
ingress) or as a ``uint8`` ``H x W x C`` image (RGB, as local sources send frames). Here, on
a worker, the image is decoded (OpenCV, to BGR as video frames are) and prepared as a source
frame would be (`agent.models.preprocess`); its geometry goes out with every chunk (the
reply stream's `extra`) and the decode and preprocess times with the `timing`. A tensor of
the model's own shape passes as it is.

:func:`bind_outputs` hands the job the version's `[[postprocess]]` (bound to the image's
geometry, so boxes come back in the source image's pixels) and the reply compression the
request asked for (`params.reply_compression`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.inference.job import Job
from agent.inference.reply_stream import ReplyRefused
from agent.models.backends.base import Array, InferenceError, TensorSpec
from agent.models.manager import LoadedVersion
from agent.models.preprocess import PreprocessError, image_input, load_cv2, preprocess_image
from agent.models.resize import Geometry
from agent.protocol.errors import WireError
from agent.protocol.images import EncodedImage

__all__ = ["bind_compression", "bind_outputs", "decode_image", "is_image", "prepared_inputs"]

REPLY_COMPRESSIONS = ("zstd",)
_UINT8 = np.dtype(np.uint8)


def decode_image(image: EncodedImage, request_id: str | None, name: str) -> Array:
    """The BGR pixels of a JPEG or PNG input (`bad_request` when it does not decode to the
    size its header declared, which bounded it)."""
    cv2 = load_cv2()
    if cv2 is None:
        raise WireError(
            "model_error",
            "decoding JPEG/PNG inputs needs OpenCV on the agent (pip install "
            "opencv-python-headless, the `video` extra)",
            request_id,
        )
    header = image.header
    try:
        pixels = cv2.imdecode(np.asarray(image, dtype=np.uint8), cv2.IMREAD_COLOR)
    except cv2.error as e:
        raise WireError(
            "bad_request", f"input {name!r}: the {header.kind} does not decode: {e}", request_id
        ) from None
    declared = {(header.height, header.width), (header.width, header.height)}  # EXIF rotation
    if pixels is None or tuple(pixels.shape[:2]) not in declared:
        raise WireError(
            "bad_request", f"input {name!r}: the {header.kind} does not decode", request_id
        )
    result: Array = pixels
    return result


def _is_pixels(value: Array, spec: TensorSpec | None) -> bool:
    """A uint8 H x W (x 1, 3 or 4) image given where the model takes something else."""
    if value.dtype != _UINT8 or value.ndim not in (2, 3):
        return False
    if value.ndim == 3 and value.shape[2] not in (1, 3, 4):
        return False
    return spec is None or spec.dtype != _UINT8 or len(spec.shape) != value.ndim


def is_image(value: Any, specs: Sequence[TensorSpec], target: str) -> bool:
    """Whether `value`, given for the `[preprocess]` input `target`, is an image to decode
    or prepare (then a worker checks it, after preparing it), not the model's own tensor."""
    if isinstance(value, EncodedImage):
        return True
    spec = next((s for s in specs if s.name == target), None)
    return isinstance(value, np.ndarray) and _is_pixels(value, spec)


def prepared_inputs(
    job: Job, loaded: LoadedVersion, inputs: Mapping[str, Any]
) -> tuple[Mapping[str, Any], Geometry | None]:
    """The request's `inputs` with its image (if it sent one) decoded and preprocessed, and
    the image's geometry; the decode and preprocess times go to `job.timing`."""
    config = loaded.preprocess
    specs = loaded.session.inputs
    target = image_input(config, specs)
    value = inputs.get(target) if target is not None else None
    if config is None or target is None or not isinstance(value, np.ndarray):
        return inputs, None
    request_id = job.request.id
    if not is_image(value, specs, target):
        return inputs, None
    encoded = isinstance(value, EncodedImage)
    started = time.perf_counter()
    pixels = decode_image(value, request_id, target) if isinstance(value, EncodedImage) else value
    decoded = time.perf_counter()
    try:
        prepared, geometry = preprocess_image(pixels, config, bgr=encoded)
    except PreprocessError as e:
        raise WireError("bad_request", f"input {target!r}: {e}", request_id) from None
    done = time.perf_counter()
    if encoded:
        job.timing["decode_ms"] = round((decoded - started) * 1000, 3)
    job.timing["preprocess_ms"] = round((done - decoded) * 1000, 3)
    return {**inputs, target: prepared}, geometry


def bind_compression(job: Job) -> None:
    """The reply's compression, as `params.reply_compression` asks (every mode)."""
    asked = job.request.params.get("reply_compression")
    if asked is not None and asked not in REPLY_COMPRESSIONS:
        raise WireError(
            "bad_request",
            f"params.reply_compression must be one of {', '.join(REPLY_COMPRESSIONS)}",
            job.request.id,
        )
    job.reply.compression = asked


def bind_outputs(job: Job, loaded: LoadedVersion, geometry: Geometry | None) -> None:
    """The job's postprocess (the version's, bound to `geometry`), its reply's `geometry`
    and, where `params.reply_compression` asks for it, compression."""
    reply = job.reply
    bind_compression(job)
    reply.extra = {"geometry": geometry.as_wire()} if geometry is not None else None
    post = loaded.postprocess
    if post is None:
        job.post = None
        return
    texts = job.texts  # a prompt's, as tokenized (agent.inference.texts)

    def apply(outputs: dict[str, Any]) -> dict[str, Any]:
        try:
            return post.apply(outputs, geometry, texts)
        except InferenceError as e:
            raise ReplyRefused("model_error", str(e)) from e

    job.post = apply
