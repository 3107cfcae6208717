"""An image-to-text request of `mode = "generate"`: its picture made into the encoder's input.

An encoder-decoder whose encoder reads `pixel_values` (`Generation.image`: a
`VisionEncoderDecoderModel` exported by optimum's `image-to-text-with-past`, TrOCR or a ViT
captioner) takes `inputs.pixel_values` as a JPEG or PNG (bytes), an image (uint8 `H x W x 3`,
RGB) or the pixel values themselves (float `[1, 3, H, W]`, as the image processor makes them).
An image is made into pixel values as the version's image processor makes them (its
`preprocessor_config.json` read as a `[preprocess]`: `agent.models.image_processor`); the
decoder starts from `decoder_start_token_id`, with no prompt of its own.

Imports `images` (decoding), the protocol's errors and `agent.models`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from agent.inference.images import decode_image
from agent.models.encoders import PIXELS
from agent.models.preprocess import PreprocessConfig, PreprocessError, preprocess
from agent.protocol.errors import WireError
from agent.protocol.images import EncodedImage

__all__ = ["pixels_of"]


def pixels_of(inputs: Mapping[str, Any], image: PreprocessConfig) -> np.ndarray[Any, Any]:
    """The encoder's `pixel_values [1, 3, H, W]` of a request's picture (`bad_request` where
    it sent none, or one that does not decode)."""
    if sorted(inputs) != [PIXELS]:
        raise WireError(
            "bad_request",
            f"an image-to-text request takes inputs.{PIXELS} (a JPEG or PNG, an image "
            "H x W x 3 uint8, or pixel values [1, 3, H, W]), nothing else",
        )
    value = inputs[PIXELS]
    if isinstance(value, EncodedImage):
        value, bgr = decode_image(value, None, PIXELS), True
    elif isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.ndim == 4:
        if value.shape[:2] != (1, 3) or not np.isfinite(value).all():
            raise WireError("bad_request", f"inputs.{PIXELS} must be finite floats [1, 3, H, W]")
        size = _processed_size(image)
        if size is not None and value.shape[2:] != size:
            raise WireError(
                "bad_request",
                f"inputs.{PIXELS} must be [1, 3, {size[0]}, {size[1]}], the size the image "
                f"processor makes (got {list(value.shape)})",
            )
        return value.astype(np.float32, copy=False)
    elif isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3:
        bgr = False
    else:
        raise WireError(
            "bad_request",
            f"inputs.{PIXELS} must be a JPEG or PNG, an image H x W x 3 uint8, or pixel values "
            "[1, 3, H, W]",
        )
    try:  # the image processor's [preprocess] is batched: NCHW, [1, 3, H, W]
        return preprocess(value, image, bgr=bgr)
    except PreprocessError as e:
        raise WireError("bad_request", f"inputs.{PIXELS}: {e}") from None


def _processed_size(image: PreprocessConfig) -> tuple[int, int] | None:
    """The height and width every picture is made into, where the processor fixes them (a
    resize to a size, or a crop): the encoder's positions are that many."""
    if image.resize is None or image.resize_mode not in ("stretch", "crop"):
        return None
    return image.resize[0], image.resize[1]
